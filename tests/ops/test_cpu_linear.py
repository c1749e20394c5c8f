"""The few-row CPU matmul (ops/cpu_linear.py, csrc/linear.c) against float64 matmuls in torch,
over shapes that hit every edge of its tiling; its dispatch from `layers.linear`; and a whole model's
decode with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.models import layers
from pagedserve.models.layers import PackedWeight, linear
from pagedserve.ops import native
from pagedserve.ops import cpu_linear


DTYPES = [torch.float32, torch.bfloat16]


def kernel_isa(dtype: torch.dtype) -> str | None:
    """The instructions csrc/linear.c computes `dtype` with in this build (this CPU's, or those of
    the -march that PAGEDSERVE_NATIVE_MARCH names): AVX-512 (bfloat16 only with its BF16 dot
    products), else AVX2 with FMA (bfloat16 widened to float32), else none."""
    defines = native.target_defines("linear")
    if "__AVX512F__" in defines:
        return "avx512" if dtype == torch.float32 or "__AVX512BF16__" in defines else None
    return "avx2" if {"__AVX2__", "__FMA__"} <= defines else None


def require(dtype: torch.dtype) -> torch.dtype:
    """The kernel must run in every dtype this CPU has the instructions for (a build that silently
    fell back fails here, it does not skip)."""
    has = kernel_isa(dtype) is not None
    assert cpu_linear._dtype_supported(dtype) == has
    if not has:
        pytest.skip(f"this CPU has no instructions csrc/linear.c uses for {dtype}")
    return dtype


@pytest.fixture(params=DTYPES, ids=["float32", "bfloat16"])
def dtype(request):
    return require(request.param)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if bias is None else bias.double())


def assert_close_to_reference(y, x, w, bias):
    """Within the a-priori bound of a float32 sum of k products, k * 2^-24 * sum |x w| (plus the
    bias), and for bfloat16 results, the final rounding to 8 bits."""
    expected = reference(x, w, bias)
    magnitude = F.linear(x.double().abs(), w.double().abs(), None if bias is None else bias.double().abs())
    bound = (x.shape[-1] + 1) * 2.0**-24 * magnitude
    if y.dtype == torch.bfloat16:
        bound += 2.0**-8 * expected.abs()
    assert ((y.double() - expected).abs() <= bound).all(), ((y.double() - expected).abs() - bound).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, cpu_linear.MAX_ROWS), n=st.integers(1, 200), half_k=st.integers(1, 300),
       bias=st.booleans(), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_matches_float64_for_any_shape_and_thread_count(dtype, rows, n, half_k, bias, threads, seed):
    require(dtype)
    # n: whole and partial panels of 64 columns, and halves of them (odd panel counts split
    # between threads); k: chunks of 64 steps and a remainder; rows: tiles of 6 and groups of 48.
    gen = torch.Generator().manual_seed(seed)
    k = 2 * half_k if dtype == torch.bfloat16 else 2 * half_k - seed % 2
    x, w = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = cpu_linear.linear(x, cpu_linear.pack(w), n, b)
    finally:
        torch.set_num_threads(before)
    assert y.shape == (rows, n) and y.dtype == dtype
    assert_close_to_reference(y, x, w, b)


def test_model_shapes_and_leading_dimensions(dtype):
    gen = torch.Generator().manual_seed(0)
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]:
        x, w = torch.randn(2, 3, k, generator=gen).to(dtype), (0.05 * torch.randn(n, k, generator=gen)).to(dtype)
        y = cpu_linear.linear(x, cpu_linear.pack(w), n)
        assert y.shape == (2, 3, n)
        assert_close_to_reference(y, x, w, None)


def test_bfloat16_products_are_summed_in_float32():
    require(torch.bfloat16)
    # 1 + 1 + ... in bfloat16 stops growing at 256 (its 8-bit mantissa); float32 sums reach 1000.
    x, w = torch.ones(3, 1000, dtype=torch.bfloat16), torch.ones(70, 1000, dtype=torch.bfloat16)
    assert torch.equal(cpu_linear.linear(x, cpu_linear.pack(w), 70), torch.full((3, 70), 1000.0, dtype=torch.bfloat16))


def test_what_it_takes_and_what_it_leaves_to_onednn(dtype):
    w = torch.randn(64, 10, dtype=dtype)
    assert cpu_linear.supports(torch.randn(cpu_linear.MAX_ROWS, 10, dtype=dtype), w)
    assert not cpu_linear.supports(torch.randn(cpu_linear.MAX_ROWS + 1, 10, dtype=dtype), w)
    assert not cpu_linear.supports(torch.randn(0, 10, dtype=dtype), w)
    assert not cpu_linear.supports(torch.randn(1, 10, dtype=torch.float16), w.half())
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert not cpu_linear.supports(torch.randn(1, 10, dtype=other), w)
    assert not cpu_linear.supports(torch.randn(1, 12, dtype=dtype), w)  # k differs: torch raises
    with pytest.raises(RuntimeError):
        linear(torch.randn(1, 12, dtype=dtype), w, None, PackedWeight())
    odd = torch.randn(64, 9, dtype=dtype)  # bfloat16 steps take k in pairs
    assert cpu_linear.supports(torch.randn(1, 9, dtype=dtype), odd) == (dtype == torch.float32)


def test_linear_sends_few_rows_here_and_many_to_onednn_where_it_packs_the_dtype(dtype, monkeypatch):
    calls = []
    real = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    gen = torch.Generator().manual_seed(1)
    w, bias = torch.randn(100, 96, generator=gen).to(dtype), torch.randn(100, generator=gen).to(dtype)
    packed = PackedWeight()
    for rows in (1, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1, 300):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        assert_close_to_reference(linear(x, w, bias, packed), x, w, bias)
    if layers._onednn_packs(dtype):
        assert calls == [1, cpu_linear.MAX_ROWS]
        assert set(packed.copies) == {"panels", "onednn"}
    else:  # torch's own matmul would be the alternative: several times slower here at any size
        assert calls == [1, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1, 300]
        assert set(packed.copies) == {"panels"}


def test_a_written_weight_is_repacked(dtype):
    w = torch.randn(70, 64, dtype=dtype)
    packed, x = PackedWeight(), torch.randn(4, 64, dtype=dtype)
    first = linear(x, w, None, packed)
    w.mul_(2)  # in place: same storage, new version
    assert_close_to_reference(linear(x, w, None, packed), x, w, None)
    assert not torch.equal(first, linear(x, w, None, packed))


def test_decode_with_and_without_it(embedded_model, monkeypatch):
    """Float32 decode steps (one new token per sequence, so every matmul takes this path) give the
    same greedy tokens as oneDNN's GEMM, with logits equal to rounding."""
    require(torch.float32)
    from pagedserve.attention import get_backend
    from pagedserve.attention.kv_cache import allocate_kv_cache

    model, config = embedded_model
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, config.vocab_size, (5, 30), generator=gen)
    backend = get_backend("torch")

    def decode_logits():
        caches = allocate_kv_cache(config.num_layers, 10, 16, config.num_kv_heads, config.head_dim, torch.float32)
        tables = [[2 * i, 2 * i + 1] for i in range(5)]
        md = backend.build_metadata(tables, [0] * 5, [30] * 5, 16)
        model(prompts.flatten(), md.positions, caches, md)  # 150 rows: oneDNN either way
        md = backend.build_metadata(tables, [30] * 5, [1] * 5, 16)
        hidden = model(prompts[:, -1], md.positions, caches, md)
        return model.compute_logits(hidden)

    calls = []
    real = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *a: calls.append(1) or real(*a))
    here = decode_logits()
    assert len(calls) == 4 * config.num_layers + 1  # qkv, o, gate_up, down per layer; the head
    monkeypatch.setattr(cpu_linear, "MAX_ROWS", 0)
    onednn = decode_logits()
    torch.testing.assert_close(here, onednn, rtol=1e-4, atol=1e-4)
    assert torch.equal(here.argmax(-1), onednn.argmax(-1))
