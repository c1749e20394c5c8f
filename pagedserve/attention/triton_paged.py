"""Paged attention in Triton: the GPU backend (`attention_backend="triton"`).

Same contract as `torch_ref.paged_attention` (the oracle it is tested against). Its metadata
(`TritonMetadata`) splits the step into one-token requests and the others
(`BatchedDecodeMetadata`), with the others' ids on the device for `_prefill`. Its kernels,
all reading and writing the engine's cache layout [num_blocks, block_size, num_kv_heads, head_dim]
through the block tables, never through a gathered copy:
- `_write_kv`: this step's K/V rows into their slots (slot < 0 marks a padded token: skipped);
- `_decode`: one program per (one-token request, KV head); the query heads that share the KV head
  are processed together, with an online softmax over the request's blocks;
- `_prefill`: one program per (multi-token request, query head, tile of BLOCK_M new tokens); the
  tile attends to the cached prefix through the block table and causally to itself, so prompts,
  chunks and prompts behind a prefix-cache hit run alike, any number per flat batch.
Products run in the model's dtype (an fp8 cache is widened to it, exactly) and accumulate in
float32: float32 in full IEEE precision (no TF32), bfloat16/float16 on tensor cores. An fp8 cache
(`kv_quant`) is written as x / scale, rounded to nearest even as torch rounds, and read with its
per-tensor scales folded into the scores (K) and the output (V), not into every element.

Sinks (gpt-oss: one more logit per query head's softmax, with no value) start each row's online
softmax (`_start_softmax`): running maximum the sink's logit, denominator its exp(0) = 1, output 0,
so the keys that follow rescale the sink's term as they would an earlier key's. Split decode starts
only part 0 so; `_combine` then merges it like any part.

Tests run the kernels under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors). The interpreter
checks neither tl.dot's minimum of 16 per dimension nor out-of-bounds loads, so every tile load
here is masked (scalar loads of tables and lengths stay in bounds by construction) and tl.dot is
used only on tiles of at least 16 (smaller cache blocks use a broadcast sum).

Decode splits long contexts over several programs when few requests run (split-K, "flash
decoding"), then merges the parts (`_combine`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedserve.attention.kv_cache import unit_scales
from pagedserve.attention.kv_quant import FP8_MAX, is_fp8
from pagedserve.attention.metadata import BatchedDecodeMetadata, HostStep, static_decode_fields

BLOCK_M = 16  # new tokens per prefill program
# Decode splits a request's context into parts of PARTITION_TOKENS when fewer than
# SPLIT_BELOW_PROGRAMS (request, KV head) programs would run: about the SM count of a large GPU.
# At most MAX_PARTS parts: longer contexts get longer parts (a CUDA graph's tables span max_model_len).
PARTITION_TOKENS = 512
SPLIT_BELOW_PROGRAMS = 128
MAX_PARTS = 64
_FP8_MAX = tl.constexpr(FP8_MAX)  # Triton reads module globals only as constexprs


def available(device: torch.device) -> str | None:
    """None if the kernels can run on `device`, else why not."""
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (f"attention_backend='triton' runs on CUDA GPUs, or on the CPU under Triton's interpreter "
            f"(TRITON_INTERPRET=1, for tests); this engine's device is {device.type!r}")


def fp8_supported(device: torch.device) -> str | None:
    """None if the kernels can use an fp8 cache on `device`, else why not (e4m3 needs sm_89+)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return ("kv_cache_dtype='fp8' with the Triton backend needs a GPU of compute capability 8.9 or newer; "
                "attention_backend='torch' runs it on older GPUs")
    return None


@triton.jit
def _write_kv(K, V, KCache, VCache, slot_mapping, Scales, ROW: tl.constexpr, ROW_PAD: tl.constexpr,
              FP8: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slot_mapping + i)
    cols = tl.arange(0, ROW_PAD)
    mask = (cols < ROW) & (cols * 0 + slot >= 0)  # the slot broadcast to a block: a scalar mask breaks the interpreter
    k = tl.load(K + i * ROW + cols, mask=mask)
    v = tl.load(V + i * ROW + cols, mask=mask)
    if FP8:
        k = _quantize(k, tl.load(Scales), KCache.dtype.element_ty)
        v = _quantize(v, tl.load(Scales + 1), VCache.dtype.element_ty)
    tl.store(KCache + slot * ROW + cols, k, mask=mask)
    tl.store(VCache + slot * ROW + cols, v, mask=mask)


@triton.jit
def _quantize(x, scale, dtype: tl.constexpr):
    """x / scale in e4m3, clamped to +-448 and rounded to nearest even, as kv_quant.quantize does.

    The rounding happens in float32 so that the cast itself is exact: Triton's interpreter (3.9)
    rounds up a mantissa of all ones without carrying into the exponent (31.9 became 16, not 32)."""
    y = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -_FP8_MAX, _FP8_MAX)  # `/` is approximate on GPUs
    bits = y.to(tl.int32, bitcast=True)  # keep 3 of float32's 23 mantissa bits, ties to even
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # Below 2^-6: multiples of 2^-9 (adding 1.5 * 2^14 rounds there), with y's sign, zeros included.
    subnormal = ((tl.abs(y) + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -0x80000000)
    y = tl.where(tl.abs(y) < 0.015625, subnormal.to(tl.float32, bitcast=True), normal)
    return y.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _kv_scales(Scales, FP8: tl.constexpr):
    if FP8:
        return tl.load(Scales), tl.load(Scales + 1)
    return 1.0, 1.0


@triton.jit
def _scores(q, k, USE_DOT: tl.constexpr, F32: tl.constexpr):
    """q [M, D] . k [N, D] -> [M, N] in float32. F32: products in float32, full IEEE precision;
    else in q and k's 16-bit dtype on tensor cores, accumulated in float32."""
    if USE_DOT:
        if F32:
            return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        return tl.dot(q, tl.trans(k))
    return tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _weighted(p, v, USE_DOT: tl.constexpr, F32: tl.constexpr):
    """p [M, N] (float32) . v [N, D] -> [M, D] in float32; 16-bit v: p rounded to v's dtype for
    the tensor cores, as flash attention does."""
    if USE_DOT:
        if F32:
            return tl.dot(p, v.to(tl.float32), input_precision="ieee")
        return tl.dot(p.to(v.dtype), v)
    return tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _start_softmax(Sinks, heads, valid, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The running maximum and softmax denominator [ROWS] before any key, of query heads `heads`
    (rows where `valid`): the sink logit alone (and exp(0) = 1), or nothing yet, at a finite start
    for the maximum (a block whose keys are all hidden adds exp(-inf) = 0)."""
    if HAS_SINKS:
        m = tl.load(Sinks + heads, mask=valid, other=-1e30).to(tl.float32)
        return m, tl.where(valid, 1.0, 0.0)
    return tl.full([ROWS], -1e30, tl.float32), tl.zeros([ROWS], tl.float32)


@triton.jit
def _online_softmax(s, v, m, denom, acc, USE_DOT: tl.constexpr, F32: tl.constexpr):
    """Fold one block of scores s [M, N] (hidden keys at -inf) and values v [N, D] into the running
    maximum m [M], softmax denominator [M] and unnormalised output acc [M, D]."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    return m_new, denom * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + _weighted(p, v, USE_DOT, F32)


@triton.jit
def _decode(Q, KCache, VCache, Out, PartMax, PartDenom, PartAcc, token_indices, block_tables, seq_lens,
            table_stride, scale, window, part_blocks, Scales, Sinks,
            NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
            HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_DOT: tl.constexpr,
            SPLIT: tl.constexpr, FP8: tl.constexpr, F32: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Program (r, kv_head, part) attends over blocks part * part_blocks .. + part_blocks of decode
    r. Unsplit (one part), it writes the output; split, it writes its running maximum, softmax
    denominator and unnormalised output for `_combine`."""
    r = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    token = tl.load(token_indices + r)
    seq_len = tl.load(seq_lens + r)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    k_scale, v_scale = _kv_scales(Scales, FP8)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    t = tl.arange(0, BLOCK_SIZE)
    q_rows = token * NUM_HEADS + kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(Q + q_rows[:, None] * HEAD_DIM + d[None, :], mask=q_mask, other=0.0)

    # The sinks join the softmax once: in part 0 (the only part when unsplit).
    first_part = g * 0 + part == 0  # broadcast to a block: a scalar in a mask breaks the interpreter
    m, denom = _start_softmax(Sinks, kv_head * GROUP + g, (g < GROUP) & first_part, GROUP_PAD, HAS_SINKS)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    start = tl.maximum(first // BLOCK_SIZE, part * part_blocks)
    for b in range(start, tl.minimum(tl.cdiv(seq_len, BLOCK_SIZE), (part + 1) * part_blocks)):
        block = tl.load(block_tables + r * table_stride + b)
        pos = b * BLOCK_SIZE + t
        visible = (pos < seq_len) & (pos >= first)
        offs = ((block * BLOCK_SIZE + t) * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
        kv_mask = visible[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(KCache + offs, mask=kv_mask, other=0.0).to(Q.dtype.element_ty)  # fp8: exact in 16 bits
        v = tl.load(VCache + offs, mask=kv_mask, other=0.0).to(Q.dtype.element_ty)
        s = tl.where(visible[None, :], _scores(q, k, USE_DOT, F32) * (scale * k_scale), float("-inf"))
        m, denom, acc = _online_softmax(s, v, m, denom, acc, USE_DOT, F32)
    acc = acc * v_scale
    if SPLIT:
        num_parts = tl.num_programs(2)
        part_rows = (r * NUM_HEADS + kv_head * GROUP + g) * num_parts + part  # [n, heads, parts]
        tl.store(PartMax + part_rows, m, mask=g < GROUP)
        tl.store(PartDenom + part_rows, denom, mask=g < GROUP)
        tl.store(PartAcc + part_rows[:, None] * HEAD_PAD + d[None, :], acc, mask=q_mask)
    else:
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # padding rows have none
        tl.store(Out + q_rows[:, None] * HEAD_DIM + d[None, :], out.to(Out.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine(Out, PartMax, PartDenom, PartAcc, token_indices, NUM_HEADS: tl.constexpr, NUM_PARTS: tl.constexpr,
             PARTS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Merge the parts of split decode (r, head): rescale each to the overall maximum."""
    r = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, PARTS_PAD)
    d = tl.arange(0, HEAD_PAD)
    rows = (r * NUM_HEADS + head) * NUM_PARTS + p
    m = tl.load(PartMax + rows, mask=p < NUM_PARTS, other=-1e30)
    denom = tl.load(PartDenom + rows, mask=p < NUM_PARTS, other=0.0)
    acc = tl.load(PartAcc + rows[:, None] * HEAD_PAD + d[None, :], mask=(p < NUM_PARTS)[:, None], other=0.0)
    weight = tl.exp(m - tl.max(m, axis=0))  # parts that saw no key nor sink have m = -1e30: weight 0
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(denom * weight, axis=0)
    token = tl.load(token_indices + r)
    tl.store(Out + (token * NUM_HEADS + head) * HEAD_DIM + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill(Q, KCache, VCache, Out, req_indices, query_start_loc, block_tables, seq_lens, table_stride, scale,
             window, Scales, Sinks, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
             HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr,
             FP8: tl.constexpr, F32: tl.constexpr, HAS_SINKS: tl.constexpr):
    r = tl.load(req_indices + tl.program_id(0))
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    q_start = tl.load(query_start_loc + r)
    num_new = tl.load(query_start_loc + r + 1) - q_start
    seq_len = tl.load(seq_lens + r)
    k_scale, v_scale = _kv_scales(Scales, FP8)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_PAD)
    t = tl.arange(0, BLOCK_SIZE)
    row_ok = rows < num_new
    q_pos = seq_len - num_new + rows  # context position of each new token
    q_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    q_offs = ((q_start + rows) * NUM_HEADS + head)[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(Q + q_offs, mask=q_mask, other=0.0)

    # Keys this tile can see: up to its last row's position, from its first row's window start.
    last = tl.minimum(seq_len - num_new + (tile + 1) * BLOCK_M, seq_len)
    first = tl.where(window > 0, tl.maximum(seq_len - num_new + tile * BLOCK_M - window + 1, 0), 0)
    m, denom = _start_softmax(Sinks, head + rows * 0, row_ok, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for b in range(first // BLOCK_SIZE, tl.cdiv(last, BLOCK_SIZE)):
        block = tl.load(block_tables + r * table_stride + b)
        pos = b * BLOCK_SIZE + t
        in_context = pos < last
        offs = ((block * BLOCK_SIZE + t) * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
        kv_mask = in_context[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(KCache + offs, mask=kv_mask, other=0.0).to(Q.dtype.element_ty)
        v = tl.load(VCache + offs, mask=kv_mask, other=0.0).to(Q.dtype.element_ty)
        visible = (pos[None, :] <= q_pos[:, None]) & in_context[None, :]
        visible = visible & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, _scores(q, k, USE_DOT, F32) * (scale * k_scale), float("-inf"))
        m, denom, acc = _online_softmax(s, v, m, denom, acc, USE_DOT, F32)
    out = acc * v_scale / tl.where(denom > 0, denom, 1.0)[:, None]  # padding rows have none
    tl.store(Out + q_offs, out.to(Out.dtype.element_ty), mask=q_mask)


@dataclass(kw_only=True)
class TritonMetadata(BatchedDecodeMetadata):
    """The split step, plus the multi-token requests' ids as a device tensor, which `_prefill`
    reads (made once per step, not once per layer)."""

    prefill_req_ids: Tensor  # [len(prefill_req_indices)] int64

    @classmethod
    def backend_fields(cls, step: HostStep, device: torch.device | str) -> dict:
        fields = super().backend_fields(step, device)
        return fields | dict(prefill_req_ids=torch.tensor(fields["prefill_req_indices"], dtype=torch.int64,
                                                          device=device))


def products_in_float32(q: Tensor) -> bool:
    """The kernels' F32: products in float32 for float32 models, and for bfloat16 under the
    interpreter (CPU tensors), whose bfloat16 tl.dot is wrong (Triton 3.9: a 16x16 product off by 2e10)."""
    return q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type == "cpu")


def paged_attention(
    q: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    k_cache: Tensor,
    v_cache: Tensor,
    md: TritonMetadata,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: Tensor | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """`torch_ref.paged_attention`'s contract, on Triton kernels (CUDA, or the interpreter)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton backend needs a power-of-two block size, got {block_size}")
    q = q.contiguous()
    row = num_kv_heads * head_dim
    kv_scales, fp8, f32 = unit_scales(kv_scales, q.device), is_fp8(k_cache), products_in_float32(q)
    if k is not None:  # None: a KV-shared layer, whose source layer stored this step's K/V
        _write_kv[(num_tokens,)](k.contiguous(), v.contiguous(), k_cache, v_cache, md.slot_mapping, kv_scales,
                                 ROW=row, ROW_PAD=triton.next_power_of_2(row), FP8=fp8)

    out = torch.empty_like(q)
    window = sliding_window or 0
    has_sinks = sinks is not None
    if has_sinks and sinks.shape != (num_heads,):
        raise ValueError(f"sinks must hold one logit per query head ({num_heads}), got shape {tuple(sinks.shape)}")
    sinks = sinks.contiguous() if has_sinks else kv_scales  # unread without sinks: any pointer will do
    head_pad = triton.next_power_of_2(head_dim)
    tables = md.block_tables
    use_dot = block_size >= 16  # tl.dot takes tiles of 16 or more (decode pads its query heads to 16)
    if md.num_decodes:
        n, group = md.num_decodes, num_heads // num_kv_heads
        # Split-K ("flash decoding"): too few (request, KV head) programs to fill the GPU, and
        # contexts long enough to cut, so each request's blocks are shared among several programs.
        width = md.decode_block_tables.shape[1]
        part_blocks = max(1, PARTITION_TOKENS // block_size, triton.cdiv(width, MAX_PARTS))
        parts = triton.cdiv(width, part_blocks)
        if n * num_kv_heads >= SPLIT_BELOW_PROGRAMS or parts < 2:
            parts, part_blocks = 1, width
        partials = [torch.empty((n, num_heads, parts, *extra), dtype=torch.float32, device=q.device)
                    for extra in ((), (), (head_pad,))] if parts > 1 else [out] * 3  # unread when unsplit
        _decode[(n, num_kv_heads, parts)](
            q, k_cache, v_cache, out, *partials, md.decode_token_indices, md.decode_block_tables,
            md.decode_seq_lens, md.decode_block_tables.stride(0), scale, window, part_blocks, kv_scales, sinks,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
            GROUP_PAD=max(triton.next_power_of_2(group), 16 if use_dot else 1), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            BLOCK_SIZE=block_size, USE_DOT=use_dot, SPLIT=parts > 1, FP8=fp8, F32=f32, HAS_SINKS=has_sinks,
        )
        if parts > 1:
            _combine[(n, num_heads)](out, *partials, md.decode_token_indices, NUM_HEADS=num_heads, NUM_PARTS=parts,
                                     PARTS_PAD=triton.next_power_of_2(parts), HEAD_DIM=head_dim, HEAD_PAD=head_pad)
    if md.prefill_req_indices:
        _prefill[(len(md.prefill_req_indices), num_heads, triton.cdiv(md.max_query_len, BLOCK_M))](
            q, k_cache, v_cache, out, md.prefill_req_ids, md.query_start_loc, tables, md.seq_lens, tables.stride(0),
            scale, window, kv_scales, sinks, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, USE_DOT=use_dot, FP8=fp8, F32=f32,
            HAS_SINKS=has_sinks,
        )
    return out


class TritonBackend:
    """attention_backend="triton": `TritonMetadata` each step, `paged_attention` in every layer."""

    name = "triton"
    forward = staticmethod(paged_attention)

    def build_metadata(self, block_tables: list[list[int]] | Tensor, num_computed_tokens: list[int],
                       num_new_tokens: list[int], block_size: int,
                       device: torch.device | str = "cpu") -> TritonMetadata:
        return TritonMetadata.build(block_tables, num_computed_tokens, num_new_tokens, block_size, device, backend=self)

    def static_decode_metadata(self, slot_mapping: Tensor, positions: Tensor, block_tables: Tensor, seq_lens: Tensor,
                               block_size: int) -> TritonMetadata:
        """Metadata over a CUDA graph's static buffers (`metadata.static_decode_fields`)."""
        return TritonMetadata(**static_decode_fields(slot_mapping, positions, block_tables, seq_lens, block_size),
                              prefill_req_ids=torch.empty(0, dtype=torch.int64, device=seq_lens.device), backend=self)
