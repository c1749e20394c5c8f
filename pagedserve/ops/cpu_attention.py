"""The C attention kernels for CPUs (csrc/paged_decode.c, csrc/paged_prefill.c), decode and prefill: load, call.

Decode attention is memory-bound: a step reads every running request's whole context. Gathering
the context into a padded tensor for SDPA copies it (read, write, read again); the kernel reads
each K/V row in place through the block table, once: on the 2-core test machine, 64 decodes with
~240 tokens of context each took 0.7 ms per layer against 5-8 ms for the SDPA path. Its blocks
lie anywhere in the pool, so while it reads one it asks for the block about 12 KiB ahead, a few
lines at a time (reading from a 30-layer pool: 22 -> 33 GB/s in float32, docs/benchmarks.md).

Prompt attention is compute-bound: the prefill kernel takes every multi-token request of a step
in one call, in flash-style tiles (a running softmax; the scores are never written out whole),
reading K/V through the block tables, so a chunk behind cached tokens needs no gathered copy. On
the same machine, one 512-token prompt of the embedded model took 1.2 ms per layer against 3.5 ms
in torch's fused CPU attention (2,048 tokens: 17.6-21.5 against 35 ms, over two sittings). For
bfloat16 queries over a bfloat16 cache on a CPU with AVX-512 BF16, it multiplies in bf16 pairs
(`has_bf16_dot`): 2,048 tokens in 12.9 ms against 19.2 in float32 (one process, alternating).
The decode kernel does the same there, reading the bfloat16 rows as they lie instead of widening
each block first, which had made it compute-bound: 32 contexts of 1,300 tokens, 0.85-0.87 ms
against 1.18-1.20 (37 against 27 GB/s; this machine reads about 40).

Both take a layer's sink logits (gpt-oss: one per query head, in the softmax's denominator with no
value) or none, and any head size that is a whole number of vectors (unrolled for 64, 128 and 256).

`ops/native.py` compiles them on first use and caches the build. Without a compiler, or
with PAGEDSERVE_CPU_KERNEL=0, `load()` returns None and attention falls back to torch's SDPA
(a warning says why, once). Every call passes the pool's size: a checked build
(PAGEDSERVE_NATIVE_CHECKS=1, `native.build_flags`) refuses a block id outside the pool with an
IndexError instead of reading out of bounds.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from pagedserve.ops import native

VECTOR_WIDTH = 16  # floats per vector in the kernel (VL): head_dim must be a multiple


@functools.cache
def load(flags: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """The kernel library, compiled if needed (with `native.build_flags` unless `flags` are given);
    None if it is disabled or cannot be built."""
    lib = native.optional_library("paged_attention", "attention uses the slower SDPA paths",
                                  None if flags is None else list(flags))
    if lib is None:
        return None
    fn = lib.paged_decode_attention
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr] * 7 + [i64] * 8 + [ctypes.c_float, i64, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                           ctypes.c_float, ctypes.c_int, ptr]
    fn.restype = ctypes.c_int
    fn = lib.paged_prefill_attention
    fn.argtypes = [ptr] * 8 + [i64] * 7 + [ctypes.c_float, i64, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                           ctypes.c_float, ctypes.c_int, ptr]
    fn.restype = ctypes.c_int
    lib.has_bf16_dot.argtypes, lib.has_bf16_dot.restype = [], ctypes.c_int
    return lib


def has_bf16_dot() -> bool:
    """Whether the kernels were built with their bfloat16 paths (bfloat16 queries over a bfloat16
    cache, head_dim a multiple of 32, on a CPU with AVX-512 BF16), decode and prefill: both products
    in bf16 pair dot products with float32 sums, the probabilities rounded to bfloat16 first, as
    torch's fused CPU attention does."""
    lib = load()
    return lib is not None and bool(lib.has_bf16_dot())


# The cache's element type, as the kernel's `format` argument names it.
FP8_DTYPE = torch.float8_e4m3fn  # the fp8 KV cache's element type (attention/kv_quant.py)
KV_FORMATS = {torch.float32: 0, FP8_DTYPE: 1, torch.bfloat16: 2}


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the kernel can run this attention: float32 or bfloat16 queries and a float32,
    bfloat16 or fp8 cache in CPU memory, and a head size that is a whole number of the kernel's
    vectors (64, 80, 96, 128, 256, 512... not 72)."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k_cache.dtype in KV_FORMATS
            and k_cache.shape[-1] % VECTOR_WIDTH == 0)


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    out: Tensor,
    token_indices: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None,
    kv_scales: Tensor | None = None,
    sinks: Tensor | None = None,
) -> None:
    """Write into out[token_indices] the attention of q[token_indices] (one token per request)
    over each request's first seq_lens[r] cached positions, read through block_tables[r].

    q, out: [num_tokens, num_heads, head_dim], both float32 or both bfloat16 (the kernel computes
    in float32: it widens bfloat16 queries and rounds outputs once; except bfloat16 q over a
    bfloat16 cache where `has_bf16_dot`); out contiguous; q is read in
    place when its heads are contiguous within a token (tokens may lie further apart: a view of
    the fused qkv output), else from a contiguous copy;
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], float32, bfloat16 or fp8 (read times
    kv_scales[0] and kv_scales[1]); token_indices, seq_lens: [n] int64; block_tables:
    [n, >= max blocks] int64; sinks: [num_heads] float32 sink logits (gpt-oss), or None. Requires
    `load()` to have returned a library.
    """
    lib = load()
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    n, num_heads = token_indices.shape[0], q.shape[1]
    if not q[0:1].is_contiguous():  # heads apart within a token: the kernel cannot stride them
        q = q.contiguous()
    for t in (out, k_cache, v_cache, token_indices, block_tables, seq_lens):
        assert t.is_contiguous(), "the kernel reads raw memory: tensors must be contiguous"
    assert q.dtype == out.dtype, "q and out share one dtype"
    check_sinks(sinks, num_heads)
    bf16 = q.dtype == torch.bfloat16
    fp8 = k_cache.dtype == FP8_DTYPE
    k_scale, v_scale = kv_scales.tolist() if fp8 and kv_scales is not None else (1.0, 1.0)
    kv_format = KV_FORMATS[k_cache.dtype]
    status = native.call(
        lib.paged_decode_attention, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        token_indices.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        n, q.stride(0), block_tables.shape[1], num_blocks, block_size, num_heads, num_kv_heads, head_dim,
        scale, sliding_window or 0, torch.get_num_threads(), kv_format, k_scale, v_scale, int(bf16),
        None if sinks is None else sinks.data_ptr(),
    )
    check_status(status, "decode", block_tables, seq_lens, num_blocks, block_size)


def prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    out: Tensor,
    q_starts: Tensor,
    num_new: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None,
    kv_scales: Tensor | None = None,
    sinks: Tensor | None = None,
) -> None:
    """Write into out the attention of multi-token requests: request r's new tokens are rows
    q_starts[r] .. q_starts[r] + num_new[r] - 1 of q, at positions seq_lens[r] - num_new[r] ..
    seq_lens[r] - 1, and see every cached position up to their own (within the window). Their K/V,
    the new tokens' included, are already in the cache. Only those requests' rows of out are
    written. q, out: both float32 or both bfloat16 (computed in float32, as in `decode_attention`,
    except bfloat16 q over a bfloat16 cache where `has_bf16_dot`); the rest as for
    `decode_attention`; q_starts, num_new, seq_lens: [n] int64."""
    assert q.dtype == out.dtype, "q and out share one dtype"
    check_sinks(sinks, q.shape[1])
    lib = load()
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for t in (q, out, k_cache, v_cache, q_starts, num_new, block_tables, seq_lens):
        assert t.is_contiguous(), "the kernel reads raw memory: tensors must be contiguous"
    fp8 = k_cache.dtype == FP8_DTYPE
    k_scale, v_scale = kv_scales.tolist() if fp8 and kv_scales is not None else (1.0, 1.0)
    status = native.call(
        lib.paged_prefill_attention, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        q_starts.data_ptr(), num_new.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        q_starts.shape[0], block_tables.shape[1], num_blocks, block_size, q.shape[1], num_kv_heads, head_dim,
        scale, sliding_window or 0, torch.get_num_threads(), KV_FORMATS[k_cache.dtype], k_scale, v_scale,
        int(q.dtype == torch.bfloat16), None if sinks is None else sinks.data_ptr(),
    )
    check_status(status, "prefill", block_tables, seq_lens, num_blocks, block_size)


def check_sinks(sinks: Tensor | None, num_heads: int) -> None:
    """The kernels read sink logits as raw float32, one per query head."""
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.shape == (num_heads,), \
            f"sinks must be [{num_heads}] contiguous float32, got {tuple(sinks.shape)} {sinks.dtype}"
        assert sinks.device.type == "cpu", "sinks must be in CPU memory"


# The kernels' status codes (csrc/paged_attention.h); the last two only from a checked build.
NO_MEMORY, BAD_BLOCK, SHORT_TABLE = -1, -2, -3


def check_status(status: int, kernel: str, block_tables: Tensor, seq_lens: Tensor, num_blocks: int,
                 block_size: int) -> None:
    """Raise the error a kernel's status stands for: MemoryError, or IndexError naming the request
    whose block table the checked build refused."""
    if status == 0:
        return
    if status == NO_MEMORY:
        raise MemoryError(f"the CPU {kernel} attention kernel could not allocate its scratch space")
    if status not in (BAD_BLOCK, SHORT_TABLE):
        raise RuntimeError(f"the CPU {kernel} attention kernel failed with status {status}")
    for r, (table, seq_len) in enumerate(zip(block_tables.tolist(), seq_lens.tolist())):
        needed = -(-seq_len // block_size)
        if needed > len(table):
            raise IndexError(f"CPU {kernel} attention: request {r} has {seq_len} tokens, more than its block "
                             f"table of {len(table)} blocks of {block_size} holds")
        bad = [b for b in table[:needed] if not 0 <= b < num_blocks]
        if bad:
            raise IndexError(f"CPU {kernel} attention: request {r}'s block table holds block id {bad[0]}, "
                             f"outside the pool of {num_blocks} blocks")
    raise IndexError(f"CPU {kernel} attention: a block table holds a block id outside the pool of {num_blocks} "
                     "blocks")
