"""The C attention kernels (ops/cpu_attention.py), decode and prefill: they build here, cache
their build, agree with the oracle on long contexts with windows and grouped heads, on every cache
type and on chunks behind cached tokens, do not depend on the thread count, write only their own
rows, and their absence is a fallback rather than a failure; head sizes 64 to 512 (Gemma's 256 and
512 included), and sinks on every path. Random mixed steps are in test_sdpa.py."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from pagedserve.attention import torch_ref
from pagedserve.attention.kv_quant import FP8_DTYPE, dequantize, quantize
from pagedserve.attention.metadata import BatchedDecodeMetadata
from pagedserve.attention.sdpa import SdpaMetadata
from pagedserve.ops import cpu_attention, native


@pytest.fixture
def fresh_load():
    """cpu_attention.load() re-evaluated under the test's environment, and the real one restored."""
    cpu_attention.load.cache_clear()
    yield cpu_attention.load
    cpu_attention.load.cache_clear()


# (KV heads, query heads, head size): grouped and plain heads, the kernels' unrolled sizes (64, 128,
# 256), a generic one (80) and Gemma 4's full-attention 512.
SHAPES = [(3, 9, 64), (1, 8, 128), (4, 4, 80), (2, 4, 256), (1, 2, 512)]


def tolerance(dim: int) -> float:
    """Float32 kernels against the float32 oracle: their dot products round in another order, by
    more the longer they are."""
    return 1e-5 * max(1, dim // 128)


def decode_case(seq_lens, block_size, kv_heads, heads, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(needed) + 2, generator=gen).tolist()
    tables = [perm[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(seq_lens))]
    shape = (len(perm), block_size, kv_heads, dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    md = BatchedDecodeMetadata.build(tables, [s - 1 for s in seq_lens], [1] * len(seq_lens), block_size)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen)
    return q, k_cache, v_cache, md


def run_kernel(q, k_cache, v_cache, md, scale, window, kv_scales=None, sinks=None):
    out = torch.full_like(q, float("nan"))
    cpu_attention.decode_attention(q, k_cache, v_cache, out, md.decode_token_indices, md.decode_block_tables,
                                md.decode_seq_lens, scale, window, kv_scales, sinks)
    return out


@pytest.mark.parametrize("window", [None, 1, 100, 4096])
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
def test_long_contexts_match_the_oracle(window, kv_heads, heads, dim):
    q, k_cache, v_cache, md = decode_case([1, 17, 700, 2500, 33], 16, kv_heads, heads, dim)
    q *= 3  # sharp softmaxes as well as flat ones: exp over a wide range
    out = run_kernel(q, k_cache, v_cache, md, dim**-0.5, window)
    # The oracle also writes this step's K/V: give it the values already in their slots.
    slots = md.slot_mapping
    k = k_cache.view(-1, kv_heads, dim)[slots].clone()
    v = v_cache.view(-1, kv_heads, dim)[slots].clone()
    expected = torch_ref.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), md, dim**-0.5, window)
    assert (out - expected).abs().max().item() < tolerance(dim)


@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
def test_fp8_cache_matches_the_oracle(kv_heads, heads, dim):
    q, k_cache, v_cache, md = decode_case([1, 17, 700, 2500, 33], 16, kv_heads, heads, dim, seed=2)
    scales = torch.tensor([0.03, 0.02])
    k8, v8 = quantize(k_cache * 5, scales[0]), quantize(v_cache, scales[1])  # subnormal to saturated e4m3 values
    out = torch.full_like(q, float("nan"))
    cpu_attention.decode_attention(q, k8, v8, out, md.decode_token_indices, md.decode_block_tables,
                                md.decode_seq_lens, dim**-0.5, 100, scales)
    slots = md.slot_mapping
    k = dequantize(k8.view(torch.uint8).view(-1, kv_heads, dim)[slots].view(FP8_DTYPE), torch.float32, scales[0])
    v = dequantize(v8.view(torch.uint8).view(-1, kv_heads, dim)[slots].view(FP8_DTYPE), torch.float32, scales[1])
    expected = torch_ref.paged_attention(q, k, v, k8.clone(), v8.clone(), md, dim**-0.5, 100, scales)
    assert (out - expected).abs().max().item() < tolerance(dim)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
def test_bfloat16_cache_matches_the_oracle_in_float32(q_dtype, kv_heads, heads, dim):
    """A bfloat16 cache is read without a float32 copy of the context; the kernel computes in
    float32, so it equals the oracle on the widened values, up to rounding the output once."""
    q, k_cache, v_cache, md = decode_case([1, 17, 700, 2500, 33], 16, kv_heads, heads, dim, seed=3)
    q, k16, v16 = (q * 3).to(q_dtype), k_cache.bfloat16(), v_cache.bfloat16()
    out = torch.full_like(q, float("nan"))
    cpu_attention.decode_attention(q, k16, v16, out, md.decode_token_indices, md.decode_block_tables,
                                md.decode_seq_lens, dim**-0.5, 100)
    slots = md.slot_mapping
    k, v = k16.float().view(-1, kv_heads, dim)[slots].clone(), v16.float().view(-1, kv_heads, dim)[slots].clone()
    expected = torch_ref.paged_attention(q.float(), k, v, k16.float(), v16.float(), md, dim**-0.5, 100)
    assert out.dtype == q_dtype
    assert torch.allclose(out.float(), expected.to(q_dtype).float(), atol=1e-2, rtol=0)
    assert (out.float() - expected).abs().max().item() < (tolerance(dim) if q_dtype == torch.float32 else 2e-2)


def on_one_and_on_several_threads(run):
    """run() with torch (and so the kernels) on one thread, then on at least two."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(max(2, threads))
        return one, run()
    finally:
        torch.set_num_threads(threads)


def test_result_does_not_depend_on_the_thread_count():
    q, k_cache, v_cache, md = decode_case([300, 5, 1200, 64] * 4, 16, 3, 9, 64, seed=1)
    one, many = on_one_and_on_several_threads(lambda: run_kernel(q, k_cache, v_cache, md, 0.125, None))
    assert torch.equal(one, many)  # each (request, KV head) is summed by one thread, in one order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_the_decode_rows_are_written(dtype):
    q, k_cache, v_cache, md = decode_case([40, 3], 4, 2, 4, 16)
    q = torch.cat([torch.randn(3, 4, 16), q]).to(dtype)  # three rows that belong to no decode
    md.decode_token_indices += 3
    out = run_kernel(q, k_cache.to(dtype), v_cache.to(dtype), md, 0.3, None)
    assert out[:3].isnan().all() and not out[3:].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_may_be_a_view_of_the_fused_qkv_output(dtype):
    q, k_cache, v_cache, md = decode_case([40, 3, 77], 16, 3, 9, 64)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    qkv = torch.randn(3, 9 * 64 + 2 * 3 * 64).to(dtype)
    qkv[:, : 9 * 64] = q.flatten(1)
    view = qkv[:, : 9 * 64].view(3, 9, 64)  # tokens 960 elements apart
    assert not view.is_contiguous()
    expected = run_kernel(q, k_cache, v_cache, md, 0.125, None)
    assert torch.equal(run_kernel(view, k_cache, v_cache, md, 0.125, None), expected)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_queries_are_widened_and_outputs_rounded_as_torch_does(cache_dtype):
    """bfloat16 q and out go into the kernel as they are: the result is the float32 computation on
    the widened queries, rounded to bfloat16 once (to nearest, ties to even), bit for bit; except
    over a bfloat16 cache with bf16 dot products (head size 80 keeps this case off that path)."""
    q, k_cache, v_cache, md = decode_case([1, 17, 700, 2500, 33], 16, 4, 4, 80, seed=4)
    q, k_cache, v_cache = (q * 3).bfloat16(), k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    in_bf16 = run_kernel(q, k_cache, v_cache, md, 0.125, None)
    in_float32 = run_kernel(q.float(), k_cache, v_cache, md, 0.125, None)
    assert in_bf16.dtype == torch.bfloat16 and torch.equal(in_bf16, in_float32.bfloat16())


@pytest.mark.parametrize("window", [None, 1, 100, 4096])
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES + [(2, 16, 64)])
def test_bfloat16_decode_matches_the_oracle_to_bfloat16_rounding(window, kv_heads, heads, dim):
    # bfloat16 queries over a bfloat16 cache: with AVX-512 BF16 (and dim a multiple of 32) both
    # products run in bf16 pairs and the probabilities are rounded to bfloat16 before p . V.
    # Lengths cover a part block, odd and even key counts, and a window starting mid-block.
    q, k_cache, v_cache, md = decode_case([1, 2, 17, 700, 2500, 33, 48], 16, kv_heads, heads, dim, seed=8)
    q, k16, v16 = (q * 3).bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    out = run_kernel(q, k16, v16, md, dim**-0.5, window)
    slots = md.slot_mapping
    k, v = k16.float().view(-1, kv_heads, dim)[slots].clone(), v16.float().view(-1, kv_heads, dim)[slots].clone()
    expected = torch_ref.paged_attention(q.float(), k, v, k16.float(), v16.float(), md, dim**-0.5, window)
    err = (out.float() - expected).abs()
    assert err.max().item() < 2e-2 and err.mean().item() < 2e-3  # outputs ~1: bfloat16's step there is 2^-7
    in_float32 = run_kernel(q.float(), k16, v16, md, dim**-0.5, window).bfloat16()
    assert (in_float32.float() - expected).abs().max().item() < 2e-2
    # Where the bf16 path runs the two differ (sums in another order, rounded probabilities), so
    # this case exercises it; except with a window of 1, where each query sees one key (p = 1) and
    # both give that key's V exactly.
    bf16_path = cpu_attention.has_bf16_dot() and dim % 32 == 0
    assert torch.equal(out, in_float32) == (not bf16_path or window == 1)


def test_bfloat16_decode_does_not_depend_on_the_thread_count():
    q, k_cache, v_cache, md = decode_case([300, 5, 1200, 64] * 4, 16, 3, 9, 64, seed=9)
    q, k16, v16 = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    one, many = on_one_and_on_several_threads(lambda: run_kernel(q, k16, v16, md, 0.125, None))
    assert torch.equal(one, many)


def test_a_new_load_reuses_the_cached_library(fresh_load, compiler_runs):
    # (test_native.py builds every source once into an empty cache; here the build this session
    # already made, in the usual cache, is found again.)
    assert fresh_load() is not None
    compiler_runs.clear()  # whatever the first load had to build
    fresh_load.cache_clear()
    assert fresh_load() is not None and compiler_runs == []


def test_a_broken_compiler_falls_back_with_a_warning(tmp_path, monkeypatch, fresh_load):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.warns(UserWarning, match="SDPA path"):
        assert fresh_load() is None


def test_disabled_by_environment(monkeypatch, fresh_load):
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNEL", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off on purpose: no warning
        assert fresh_load() is None


def test_supports_float32_and_bfloat16_on_cpu_and_whole_vectors_per_head():
    x = torch.zeros(2, 64)
    assert cpu_attention.supports(x, x) and cpu_attention.supports(torch.zeros(2, 80), torch.zeros(2, 80))
    assert cpu_attention.supports(x.bfloat16(), x.bfloat16()) and cpu_attention.supports(x, x.bfloat16())
    assert not cpu_attention.supports(x.half(), x.half())
    assert not cpu_attention.supports(torch.zeros(2, 72), torch.zeros(2, 72))


# ---- the prefill kernel ----------------------------------------------------------------------

# (cached tokens, new tokens) per request: whole prompts, chunks behind cached tokens, one short
# enough to be a single partial tile, one that crosses several tiles.
PREFILLS = [(0, 700), (300, 45), (0, 2), (1000, 129), (17, 33)]


def prefill_case(reqs, block_size, kv_heads, heads, dim, seed=0, decodes=()):
    """A step of multi-token requests (and one-token ones, `decodes`: their context lengths) over a
    random cache with shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    computed = [c for c, _ in reqs] + [s - 1 for s in decodes]
    new = [n for _, n in reqs] + [1] * len(decodes)
    needed = [-(-(c + n) // block_size) for c, n in zip(computed, new)]
    perm = torch.randperm(sum(needed) + 2, generator=gen).tolist()
    tables = [perm[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(needed))]
    shape = (len(perm), block_size, kv_heads, dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    md = SdpaMetadata.build(tables, computed, new, block_size)
    q = torch.randn(sum(new), heads, dim, generator=gen) * 3  # sharp softmaxes as well as flat ones
    return q, k_cache, v_cache, md


def run_prefill(q, k_cache, v_cache, md, scale, window, kv_scales=None, sinks=None):
    out = torch.full_like(q, float("nan"))
    q_starts, num_new, seq_lens, tables = md.prefill_batch(tuple(md.prefill_req_indices))
    cpu_attention.prefill_attention(q, k_cache, v_cache, out, q_starts, num_new, tables, seq_lens, scale, window,
                                 kv_scales, sinks)
    return out


def oracle(q, k_cache, v_cache, md, scale, window, kv_scales=None, widen=None, sinks=None):
    """torch_ref's attention for the step, given the K/V already in the slots (it stores them again)."""
    kv_heads, dim = k_cache.shape[2:]
    slots = md.slot_mapping
    k, v = (widen or (lambda c, i: c.view(-1, kv_heads, dim)[slots].clone()))(k_cache, 0), \
        (widen or (lambda c, i: c.view(-1, kv_heads, dim)[slots].clone()))(v_cache, 1)
    return torch_ref.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), md, scale, window, kv_scales,
                                     sinks=sinks)


@pytest.mark.parametrize("window", [None, 1, 100, 4096])
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
def test_prefill_matches_the_oracle(window, kv_heads, heads, dim):
    q, k_cache, v_cache, md = prefill_case(PREFILLS, 16, kv_heads, heads, dim)
    out = run_prefill(q, k_cache, v_cache, md, dim**-0.5, window)
    assert (out - oracle(q, k_cache, v_cache, md, dim**-0.5, window)).abs().max().item() < tolerance(dim)


def test_prefill_softmax_holds_where_most_weights_underflow():
    # Scores spread over thousands: most exponentials fall below float32's range (the kernel
    # flushes those under 2^-125 to 0) and each row's running max jumps from tile to tile.
    q, k_cache, v_cache, md = prefill_case(PREFILLS, 16, 3, 9, 64, seed=5)
    q = q * 100
    out = run_prefill(q, k_cache, v_cache, md, 0.125, None)
    assert (out - oracle(q, k_cache, v_cache, md, 0.125, None)).abs().max().item() < 1e-5


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_prefill_reads_any_block_size(block_size):
    q, k_cache, v_cache, md = prefill_case(PREFILLS, block_size, 2, 6, 64, seed=4)
    out = run_prefill(q, k_cache, v_cache, md, 0.125, 50)
    assert (out - oracle(q, k_cache, v_cache, md, 0.125, 50)).abs().max().item() < 1e-5


def test_prefill_over_an_fp8_cache_matches_the_oracle():
    q, k_cache, v_cache, md = prefill_case(PREFILLS, 16, 3, 9, 64, seed=2)
    scales = torch.tensor([0.03, 0.02])
    k8, v8 = quantize(k_cache * 5, scales[0]), quantize(v_cache, scales[1])  # subnormal to saturated e4m3 values
    out = run_prefill(q, k8, v8, md, 0.125, 100, scales)

    def widen(cache, i):
        return dequantize(cache.view(torch.uint8).view(-1, 3, 64)[md.slot_mapping].view(FP8_DTYPE), torch.float32,
                          scales[i])

    # Scores reach ~100 here; the kernel scales them by scale x k_scale once, the oracle widens K
    # by k_scale first: float32 rounding of the two orders differs by a few 1e-5 after softmax.
    assert (out - oracle(q, k8, v8, md, 0.125, 100, scales, widen)).abs().max().item() < 1e-4


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_prefill_over_a_bfloat16_cache_matches_the_oracle(q_dtype):
    q, k_cache, v_cache, md = prefill_case(PREFILLS, 16, 3, 9, 64, seed=3)
    q, k16, v16 = q.to(q_dtype), k_cache.bfloat16(), v_cache.bfloat16()
    out = run_prefill(q, k16, v16, md, 0.125, None)
    expected = oracle(q.float(), k16.float(), v16.float(), md, 0.125, None)
    assert out.dtype == q_dtype
    assert (out.float() - expected).abs().max().item() < (1e-5 if q_dtype == torch.float32 else 2e-2)


def build_has_avx512_bf16() -> bool:
    """Whether the kernels' build targets AVX-512 BF16: this CPU has it (-march=native), or the
    -march that PAGEDSERVE_NATIVE_MARCH names does."""
    return "__AVX512BF16__" in native.target_defines("paged_attention")


def test_the_bf16_dot_path_is_built_where_the_build_targets_avx512_bf16():
    assert cpu_attention.has_bf16_dot() == build_has_avx512_bf16()
    if native.MARCH_ENV not in os.environ:  # -march=native: the CPU's own instructions
        with open("/proc/cpuinfo") as f:
            cpu_has = any("avx512_bf16" in line.split() for line in f if line.startswith("flags"))
        assert build_has_avx512_bf16() == cpu_has


def bf16_prefill_case(kv_heads, heads, dim, seed):
    q, k_cache, v_cache, md = prefill_case(PREFILLS, 16, kv_heads, heads, dim, seed=seed)
    return q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), md


@pytest.mark.parametrize("window", [None, 1, 100, 4096])
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
def test_bfloat16_prefill_matches_the_oracle_to_bfloat16_rounding(window, kv_heads, heads, dim):
    # bfloat16 queries over a bfloat16 cache: with AVX-512 BF16 (and dim a multiple of 32) both
    # products run in bf16 pairs and the probabilities are rounded to bfloat16 before p . V.
    q, k16, v16, md = bf16_prefill_case(kv_heads, heads, dim, seed=5)
    out = run_prefill(q, k16, v16, md, dim**-0.5, window)
    expected = oracle(q.float(), k16.float(), v16.float(), md, dim**-0.5, window)
    err = (out.float() - expected).abs()
    assert err.max().item() < 2e-2 and err.mean().item() < 2e-3  # outputs ~1: bfloat16's step there is 2^-7
    # The float32 path (the same bfloat16 values, widened) agrees as closely; where the bf16 path
    # runs, the two differ (rounded probabilities), so this case exercises it; except with a window
    # of 1, where each row sees one key (p = 1) and both give that key's V exactly.
    in_float32 = run_prefill(q.float(), k16, v16, md, dim**-0.5, window).bfloat16()
    assert (in_float32.float() - expected).abs().max().item() < 2e-2
    bf16_path = cpu_attention.has_bf16_dot() and dim % 32 == 0
    assert torch.equal(out, in_float32) == (not bf16_path or window == 1)


def test_bfloat16_prefill_does_not_depend_on_the_thread_count():
    q, k16, v16, md = bf16_prefill_case(3, 9, 64, seed=6)
    one, many = on_one_and_on_several_threads(lambda: run_prefill(q, k16, v16, md, 0.125, None))
    assert torch.equal(one, many)


def test_prefill_does_not_depend_on_the_thread_count():
    q, k_cache, v_cache, md = prefill_case(PREFILLS * 2, 16, 3, 9, 64, seed=1)
    one, many = on_one_and_on_several_threads(lambda: run_prefill(q, k_cache, v_cache, md, 0.125, None))
    assert torch.equal(one, many)  # each (request, tile, KV head) is summed by one thread, in one order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_writes_only_the_rows_of_multi_token_requests(dtype):
    q, k_cache, v_cache, md = prefill_case([(0, 40), (10, 7)], 4, 2, 4, 32, decodes=[30, 5])
    out = run_prefill(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), md, 0.3, None)
    assert not out[:47].isnan().any() and out[47:].isnan().all()  # the two decode rows come last


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8_DTYPE])
def test_bfloat16_prefill_widens_queries_and_rounds_outputs_as_torch_does(cache_dtype):
    """bfloat16 q and out go into the prefill kernel as they are: over a cache it reads in float32
    arithmetic, the result is the float32 computation on the widened queries rounded to bfloat16
    once, bit for bit."""
    q, k_cache, v_cache, md = prefill_case([(0, 300), (100, 77)], 16, 3, 9, 64, seed=5)
    if cache_dtype == FP8_DTYPE:
        k_cache, v_cache = quantize(k_cache, torch.tensor(0.02)), quantize(v_cache, torch.tensor(0.02))
    q = q.bfloat16()
    in_bf16 = run_prefill(q, k_cache, v_cache, md, 0.125, None)
    in_float32 = run_prefill(q.float(), k_cache, v_cache, md, 0.125, None)
    assert in_bf16.dtype == torch.bfloat16 and torch.equal(in_bf16, in_float32.bfloat16())


# ---- sinks -------------------------------------------------------------------------------------

FP8_SCALES = torch.tensor([0.03, 0.02])


def sinks_for(heads: int, seed: int) -> torch.Tensor:
    """Sink logits of both signs: one far above every score (its head's output near 0), one far
    below (no mass taken), the others among the scores."""
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 3
    sinks[0], sinks[-1] = 25.0, -25.0
    return sinks


def in_cache_format(q, k_cache, v_cache, cache: str):
    """(the kernel's q, K, V, kv_scales; the oracle's q, K, V, kv_scales, widen) for a cache of type
    `cache`: bfloat16 queries over a bfloat16 cache (its bf16 dot path where the CPU has one), float32
    queries over float32 or fp8, the oracle given the float32 values the cache holds."""
    if cache == "float32":
        return (q, k_cache, v_cache, None), (q, k_cache, v_cache, None, None)
    if cache == "bfloat16":
        q16, k16, v16 = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
        return (q16, k16, v16, None), (q16.float(), k16.float(), v16.float(), None, None)
    k8, v8 = quantize(k_cache, FP8_SCALES[0]), quantize(v_cache, FP8_SCALES[1])
    shape = (-1, *k_cache.shape[2:])

    def widen(c, i, slots):
        return dequantize(c.view(torch.uint8).view(shape)[slots].view(FP8_DTYPE), torch.float32, FP8_SCALES[i])

    return (q, k8, v8, FP8_SCALES), (q, k8, v8, FP8_SCALES, widen)


def assert_close_to_oracle(out, expected, cache: str, dim: int):
    err = (out.float() - expected).abs()
    if cache == "bfloat16":
        assert err.max().item() < 2e-2 and err.mean().item() < 2e-3  # bfloat16 outputs: a step of 2^-7 near 1
    else:  # fp8: the kernel scales scores by scale x k_scale once, the oracle widens K first
        assert err.max().item() < (1e-4 if cache == "fp8" else tolerance(dim))


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("window", [None, 1, 100])
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
def test_decode_with_sinks_matches_the_oracle(cache, window, kv_heads, heads, dim):
    q, k_cache, v_cache, md = decode_case([1, 2, 17, 700, 33, 48], 16, kv_heads, heads, dim, seed=11)
    (q, k, v, scales), (ref_q, ref_k, ref_v, ref_scales, widen) = in_cache_format(q * 3, k_cache, v_cache, cache)
    sinks = sinks_for(heads, dim)
    out = run_kernel(q, k, v, md, dim**-0.5, window, scales, sinks)
    widen_slots = widen and (lambda c, i: widen(c, i, md.slot_mapping))
    expected = oracle(ref_q, ref_k, ref_v, md, dim**-0.5, window, ref_scales, widen_slots, sinks)
    assert_close_to_oracle(out, expected, cache, dim)
    # The sinks took mass: without them the output is another (a window of 1 and a sink far below
    # leave the last head its one key's V either way).
    plain = oracle(ref_q, ref_k, ref_v, md, dim**-0.5, window, ref_scales, widen_slots)
    assert (plain[:, :-1] - expected[:, :-1]).abs().max().item() > 0.1
    assert expected[:, 0].abs().max().item() < 1e-3  # the sink far above: (nearly) nothing of V


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("window", [None, 1, 100])
@pytest.mark.parametrize("kv_heads, heads, dim", SHAPES)
def test_prefill_with_sinks_matches_the_oracle(cache, window, kv_heads, heads, dim):
    q, k_cache, v_cache, md = prefill_case(PREFILLS, 16, kv_heads, heads, dim, seed=12)
    (q, k, v, scales), (ref_q, ref_k, ref_v, ref_scales, widen) = in_cache_format(q, k_cache, v_cache, cache)
    sinks = sinks_for(heads, dim)
    out = run_prefill(q, k, v, md, dim**-0.5, window, scales, sinks)
    widen_slots = widen and (lambda c, i: widen(c, i, md.slot_mapping))
    expected = oracle(ref_q, ref_k, ref_v, md, dim**-0.5, window, ref_scales, widen_slots, sinks)
    assert_close_to_oracle(out, expected, cache, dim)
    plain = oracle(ref_q, ref_k, ref_v, md, dim**-0.5, window, ref_scales, widen_slots)
    assert (plain[:, :-1] - expected[:, :-1]).abs().max().item() > 0.1
    assert expected[:, 0].abs().max().item() < 1e-3


def test_sinks_do_not_change_the_result_with_the_thread_count():
    q, k_cache, v_cache, md = prefill_case(PREFILLS, 16, 3, 9, 64, seed=13)
    sinks = sinks_for(9, 0)
    one, many = on_one_and_on_several_threads(lambda: run_prefill(q, k_cache, v_cache, md, 0.125, None, None, sinks))
    assert torch.equal(one, many)
    q, k_cache, v_cache, md = decode_case([300, 5, 1200, 64] * 4, 16, 3, 9, 64, seed=13)
    one, many = on_one_and_on_several_threads(lambda: run_kernel(q, k_cache, v_cache, md, 0.125, None, None, sinks))
    assert torch.equal(one, many)


# ---- the checked build -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def checked_build():
    """The kernels built with their bounds checks (PAGEDSERVE_NATIVE_CHECKS=1 gives every load this build)."""
    lib = cpu_attention.load(tuple(native.build_flags("paged_attention", checks=True)))
    assert lib is not None
    return lib


def _kernel_args(kernel):
    """(q, caches, out, the kernel's index tensors, its block tables, its seq_lens) of a small step."""
    if kernel == "decode":
        q, k_cache, v_cache, md = decode_case([1, 17, 70, 33], 16, 3, 9, 64)
        return q, k_cache, v_cache, [md.decode_token_indices], md.decode_block_tables.clone(), md.decode_seq_lens
    q, k_cache, v_cache, md = prefill_case([(0, 70), (30, 45), (17, 33)], 16, 3, 9, 64)
    q_starts, num_new, seq_lens, tables = md.prefill_batch(tuple(md.prefill_req_indices))
    return q, k_cache, v_cache, [q_starts, num_new], tables.clone(), seq_lens


def _run(kernel, q, k_cache, v_cache, index, tables, seq_lens):
    out = torch.zeros_like(q)
    fn = cpu_attention.decode_attention if kernel == "decode" else cpu_attention.prefill_attention
    fn(q, k_cache, v_cache, out, *index, tables.contiguous(), seq_lens, 0.125, None)
    return out


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_the_checked_build_refuses_a_block_id_outside_the_pool(kernel, checked_build, monkeypatch):
    q, k_cache, v_cache, index, tables, seq_lens = _kernel_args(kernel)
    expected = _run(kernel, q, k_cache, v_cache, index, tables, seq_lens)  # the default build
    monkeypatch.setattr(cpu_attention, "load", lambda: checked_build)
    assert torch.equal(_run(kernel, q, k_cache, v_cache, index, tables, seq_lens), expected)  # checks change nothing
    num_blocks = k_cache.shape[0]
    for bad in (num_blocks, -1, 1 << 40):
        wrong = tables.clone()
        wrong[2, 1] = bad  # a block the third request reads (its second)
        with pytest.raises(IndexError, match=f"request 2's block table holds block id {bad}, outside the pool "
                                             f"of {num_blocks} blocks"):
            _run(kernel, q, k_cache, v_cache, index, wrong, seq_lens)
    with pytest.raises(IndexError, match="more than its block table of 1 blocks"):
        _run(kernel, q, k_cache, v_cache, index, tables[:, :1], seq_lens)  # a table narrower than its context
