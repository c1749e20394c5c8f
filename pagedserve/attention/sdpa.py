"""The torch backend (`attention_backend="torch"`): paged attention for the CPU hot path.

Same contract and results as `torch_ref.paged_attention` (the oracle it is tested against), with
fewer and cheaper ops per layer. Its metadata (`SdpaMetadata`) splits the step into one-token
requests (decodes), batched, and the others, one at a time (`BatchedDecodeMetadata`):
- on CPU in float32 or bfloat16 (any cache type), one-token requests (decodes) run in the C
  kernel of `cpu_attention`, which reads K/V in place through the block tables;
- elsewhere (another dtype or device, no C compiler) decodes run through torch's fused
  scaled_dot_product_attention in a few groups of similar context length
  (`SdpaMetadata.decode_groups`): little padding, and each group's K/V, gathered a whole
  block at a time (`index_select` of contiguous rows) and read as [batch, kv_heads, keys, dim]
  strided views, stays in cache while SDPA reads it. Within a group, the query heads that share a
  KV head are that head's query rows, so grouped-query attention copies nothing;
- on CPU, multi-token requests (prompts, chunks behind cached tokens) run all together in the C
  prefill kernel of `cpu_attention` (flash-style tiles read through the block tables);
- elsewhere, multi-token requests run one at a time through torch's fused attention (scores never
  materialised; `_attend_prompt`);
- masks are built once per step by the first layer and reused by the others (`md.masks`);
- sinks (gpt-oss: one more logit per query head's softmax, with no value) go into the C kernels as
  they are; SDPA takes no sink, so its paths give each request one more key and value, both zeros,
  whose additive bias is its query head's sink logit: softmax over the scores and that 0 + sink is
  the softmax with the sink, and the zero value adds nothing (`_with_sink_bias`). Exact (the bias
  is in the queries' dtype: bfloat16 sinks in a bfloat16 model), for one more copy of the gathered
  K/V and a bias per query head and key;
- an fp8 cache is gathered as bytes and dequantized per group or request (`kv_cache.gather_blocks`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.attention.kv_cache import gather_blocks, store_kv, unit_scales
from pagedserve.attention.metadata import BatchedDecodeMetadata, static_decode_fields
from pagedserve.kv.sizes import cdiv
from pagedserve.ops import cpu_attention

# A decode group ends where a request's context falls below DECODE_GROUP_RATIO of the group's
# longest (padding then wastes under 20% of the K/V a group reads), or where it would hold more
# than DECODE_GROUP_MAX_KEYS keys in all (1.5 MB each of K and V per layer for the embedded model, so
# a group's gathered K/V is still in cache when attention reads it: on the 2-core test machine, 64
# decodes of 150-240 tokens took 6.3 ms per layer in capped groups, 8.7 ms without the cap).
DECODE_GROUP_RATIO = 0.8
DECODE_GROUP_MAX_KEYS = 2048
# A prompt with sinks runs through SDPA in runs of its new tokens whose bias (one value per query
# head, token and key) holds at most this many elements: 64 MiB in float32.
SINK_BIAS_MAX_ELEMENTS = 1 << 24


@dataclass
class DecodeGroup:
    """One-token requests attended together, each padded to the group's longest context."""

    token_indices: Tensor  # [n] batch index of each request's token
    block_ids: Tensor      # [n * num_blocks] their block tables, padded with block 0, flattened
    seq_lens: Tensor       # [n] context lengths (the new token's position + 1)
    num_blocks: int        # blocks read per request


@dataclass(kw_only=True)
class SdpaMetadata(BatchedDecodeMetadata):
    """The split step, plus what only this backend reads: decode groups for the SDPA path and the
    prefill kernel's batch (each built on first use, by the first layer that needs it), and the
    masks the first layer builds for the others (in `masks`)."""

    masks: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def decode_groups(self) -> list[DecodeGroup]:
        """The one-token requests in groups of similar context length, longest first, so that
        padding each group to its longest member reads little more K/V than the requests own."""
        qsl, seq_lens, device = self.query_start_loc_cpu, self.seq_lens_cpu, self.block_tables.device
        decodes = [i for i in range(self.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        groups = []
        for members in _group_by_length(sorted(decodes, key=lambda i: -seq_lens[i]), seq_lens):
            num_blocks = cdiv(seq_lens[members[0]], self.block_size)
            groups.append(DecodeGroup(
                token_indices=torch.tensor([qsl[i] for i in members], dtype=torch.int64, device=device),
                block_ids=self.block_tables[torch.tensor(members, device=device), :num_blocks].flatten(),
                seq_lens=torch.tensor([seq_lens[i] for i in members], dtype=torch.int64, device=device),
                num_blocks=num_blocks,
            ))
        return groups

    @functools.cached_property
    def prefill_kernel_batch(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`prefill_batch` of every multi-token request: built by the first layer, reused by the others."""
        return self.prefill_batch(tuple(self.prefill_req_indices))

    def prefill_batch(self, reqs: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Multi-token requests `reqs` as the C prefill kernel reads them: each one's first row in
        the batch, new tokens, context length and block table."""
        qsl, device = self.query_start_loc_cpu, self.block_tables.device
        starts = [qsl[i] for i in reqs]
        num_new = [qsl[i + 1] - qsl[i] for i in reqs]
        width = max(cdiv(self.seq_lens_cpu[i], self.block_size) for i in reqs)
        return (torch.tensor(starts, dtype=torch.int64, device=device),
                torch.tensor(num_new, dtype=torch.int64, device=device),
                torch.tensor([self.seq_lens_cpu[i] for i in reqs], dtype=torch.int64, device=device),
                self.block_tables[torch.tensor(reqs, device=device), :width].contiguous())


def _group_by_length(reqs: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Split requests sorted by decreasing length into runs whose shortest member is at least
    DECODE_GROUP_RATIO of the run's longest and whose padded length stays within
    DECODE_GROUP_MAX_KEYS."""
    groups: list[list[int]] = []
    for i in reqs:
        if (not groups or seq_lens[i] < DECODE_GROUP_RATIO * seq_lens[groups[-1][0]]
                or (len(groups[-1]) + 1) * seq_lens[groups[-1][0]] > DECODE_GROUP_MAX_KEYS):
            groups.append([])
        groups[-1].append(i)
    return groups


def paged_attention(
    q: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    k_cache: Tensor,
    v_cache: Tensor,
    md: SdpaMetadata,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: Tensor | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """`torch_ref.paged_attention`'s contract, on the paths in this module's docstring."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    kv_scales = unit_scales(kv_scales, q.device)
    if k is not None:  # None: a KV-shared layer, whose source layer stored this step's K/V
        store_kv(k_cache, v_cache, k, v, md.slot_mapping, kv_scales)
    k_blocks, v_blocks = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)  # one row per block
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as the kernel writes it

    if md.num_decodes and cpu_attention.supports(q, k_cache) and cpu_attention.load() is not None:
        cpu_attention.decode_attention(q, k_cache, v_cache, out, md.decode_token_indices, md.decode_block_tables,
                                    md.decode_seq_lens, scale, sliding_window, kv_scales, sinks)
    elif md.num_decodes:
        _decode_in_groups(q, k_blocks, v_blocks, kv_scales, out, md, num_kv_heads, scale, sliding_window, sinks)

    qsl, prefills = md.query_start_loc_cpu, md.prefill_req_indices
    if prefills and cpu_attention.supports(q, k_cache) and cpu_attention.load() is not None:
        q_starts, num_new, seq_lens, tables = md.prefill_kernel_batch
        cpu_attention.prefill_attention(q.contiguous(), k_cache, v_cache, out, q_starts, num_new, tables,
                                     seq_lens, scale, sliding_window, kv_scales, sinks)
        prefills = []
    for i in prefills:
        start, end, seq_len = qsl[i], qsl[i + 1], md.seq_lens_cpu[i]
        blocks = md.block_tables[i, : cdiv(seq_len, block_size)]
        keys = gather_blocks(k_blocks, blocks, q.dtype, kv_scales[0]).view(-1, num_kv_heads, head_dim)[:seq_len]
        values = gather_blocks(v_blocks, blocks, q.dtype, kv_scales[1]).view(-1, num_kv_heads, head_dim)[:seq_len]
        out[start:end] = _attend_prompt(q[start:end], keys, values, md, i, scale, sliding_window, sinks)
    return out


def _attend_prompt(q: Tensor, keys: Tensor, values: Tensor, md: SdpaMetadata, i: int, scale: float,
                   window: int | None, sinks: Tensor | None) -> Tensor:
    """Attention of multi-token request i's new tokens q [n, heads, dim] over its whole context
    keys, values [seq_len, kv_heads, dim]."""
    (n, num_heads, dim), (seq_len, num_kv_heads, _) = q.shape, keys.shape
    if sinks is not None:
        return _attend_prompt_with_sinks(q, keys, values, _prefill_mask(md, i, window), scale, sinks)
    if n == seq_len and window is None:  # a whole prompt: plain causal, no mask to read
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           values.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    # A chunk behind cached tokens (SDPA's is_causal would align it to the first key, not the last)
    # or a window: the query heads that share a KV head become its query rows, and the mask repeats.
    group = num_heads // num_kv_heads
    folded = q.view(n, num_kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * n, dim)
    mask = _prefill_mask(md, i, window).repeat(group, 1)
    o = F.scaled_dot_product_attention(folded, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                       attn_mask=mask[None, None], scale=scale)
    return o.reshape(num_kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim)


def _attend_prompt_with_sinks(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float,
                              sinks: Tensor) -> Tensor:
    """`_attend_prompt` with sinks (`_with_sink_bias`), given the request's mask [n, seq_len], in
    runs of new tokens whose bias holds at most SINK_BIAS_MAX_ELEMENTS."""
    (n, num_heads, dim), (seq_len, num_kv_heads, _) = q.shape, keys.shape
    group = num_heads // num_kv_heads
    keys, values = (_with_zero_key(x.transpose(0, 1)[None]) for x in (keys, values))  # [1, kv_heads, keys, dim]
    hidden = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out = torch.empty_like(q)
    run = max(1, SINK_BIAS_MAX_ELEMENTS // (num_heads * (seq_len + 1)))
    for r0 in range(0, n, run):
        rows = q[r0:r0 + run]
        m = rows.shape[0]
        # The query heads that share a KV head are its query rows (head-major), as in `_attend_prompt`.
        folded = rows.reshape(m, num_kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * m, dim)
        sink_column = sinks.view(num_kv_heads, group, 1).expand(num_kv_heads, group, m).reshape(1, num_kv_heads, -1, 1)
        bias = _with_sink_bias(hidden[r0:r0 + m].repeat(group, 1)[None, None], sink_column)
        o = F.scaled_dot_product_attention(folded, keys, values, attn_mask=bias, scale=scale)
        out[r0:r0 + m] = o.reshape(num_kv_heads, group, m, dim).permute(2, 0, 1, 3).reshape(m, num_heads, dim)
    return out


def _with_zero_key(x: Tensor) -> Tensor:
    """Keys or values [..., keys, dim] with one more key of zeros after the others: the sink's."""
    return torch.cat([x, x.new_zeros(*x.shape[:-2], 1, x.shape[-1])], dim=-2)


def _with_sink_bias(bias: Tensor, sink_column: Tensor) -> Tensor:
    """An additive mask [..., rows, keys] with one more column for `_with_zero_key`'s key: each
    row's sink logit (sink_column [..., rows, 1], broadcast against bias's leading dims). The zero
    key's score is 0, so its logit is the sink's; its zero value adds nothing."""
    shape = torch.broadcast_shapes(bias.shape[:-1], sink_column.shape[:-1])
    return torch.cat([bias.expand(*shape, bias.shape[-1]), sink_column.to(bias.dtype).expand(*shape, 1)], dim=-1)


def _decode_in_groups(q: Tensor, k_blocks: Tensor, v_blocks: Tensor, kv_scales: Tensor, out: Tensor,
                      md: SdpaMetadata, num_kv_heads: int, scale: float, window: int | None,
                      sinks: Tensor | None) -> None:
    """Decodes through SDPA, one `md.decode_groups` group at a time, into out."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    for i, group in enumerate(md.decode_groups):
        n = group.token_indices.shape[0]
        shape = (n, -1, num_kv_heads, head_dim)
        keys = gather_blocks(k_blocks, group.block_ids, q.dtype, kv_scales[0]).view(shape).transpose(1, 2)
        values = gather_blocks(v_blocks, group.block_ids, q.dtype, kv_scales[1]).view(shape).transpose(1, 2)
        bias = _decode_bias(md, i, keys.shape[2], window, q.dtype)
        dq = q.index_select(0, group.token_indices).view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if sinks is not None:  # a key of zeros whose bias is each query head's sink (`_with_sink_bias`)
            keys, values = _with_zero_key(keys), _with_zero_key(values)
            bias = _with_sink_bias(bias, sinks.view(1, num_kv_heads, -1, 1))
        o = F.scaled_dot_product_attention(dq, keys, values, attn_mask=bias, scale=scale)
        # reshape: CUDA's SDPA kernels may return o with strides a view cannot merge
        out.index_copy_(0, group.token_indices, o.reshape(n, num_heads, head_dim))


def _decode_bias(md: SdpaMetadata, i: int, num_keys: int, window: int | None, dtype: torch.dtype) -> Tensor:
    """Additive mask [n, 1, 1, num_keys] of decode group i: 0 where a request may see a key, -inf
    past its context (padding) or outside its window."""
    key = ("decode", i, window, dtype)
    if key not in md.masks:
        query_pos = (md.decode_groups[i].seq_lens - 1)[:, None, None, None]
        hidden = ~visible(query_pos, num_keys, window)
        md.masks[key] = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
    return md.masks[key]


def _prefill_mask(md: SdpaMetadata, i: int, window: int | None) -> Tensor:
    """Boolean mask [new tokens, seq_len] of multi-token request i."""
    key = ("prefill", i, window)
    if key not in md.masks:
        seq_len, num_new = md.seq_lens_cpu[i], md.query_start_loc_cpu[i + 1] - md.query_start_loc_cpu[i]
        query_pos = torch.arange(seq_len - num_new, seq_len, device=md.block_tables.device)[:, None]
        md.masks[key] = visible(query_pos, seq_len, window)
    return md.masks[key]


def visible(query_pos: Tensor, num_keys: int, sliding_window: int | None) -> Tensor:
    """[..., num_queries, num_keys] bool: which key positions each query position may see."""
    key_pos = torch.arange(num_keys, device=query_pos.device)
    mask = key_pos <= query_pos  # causal; also hides padding past each request's end
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


class SdpaBackend:
    """attention_backend="torch": `SdpaMetadata` each step, `paged_attention` in every layer."""

    name = "torch"
    forward = staticmethod(paged_attention)

    def build_metadata(self, block_tables: list[list[int]] | Tensor, num_computed_tokens: list[int],
                       num_new_tokens: list[int], block_size: int, device: torch.device | str = "cpu") -> SdpaMetadata:
        return SdpaMetadata.build(block_tables, num_computed_tokens, num_new_tokens, block_size, device, backend=self)

    def static_decode_metadata(self, slot_mapping: Tensor, positions: Tensor, block_tables: Tensor, seq_lens: Tensor,
                               block_size: int) -> SdpaMetadata:
        """Metadata over a CPU recording's static buffers (`metadata.static_decode_fields`)."""
        return SdpaMetadata(**static_decode_fields(slot_mapping, positions, block_tables, seq_lens, block_size),
                            backend=self)
