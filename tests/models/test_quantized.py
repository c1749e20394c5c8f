"""The quantized weight formats and ops/csrc/quant_linear.c, against gguf-py's own dequantizers and a
plain dequantize-then-matmul in torch, in the SIMD build this CPU gets and in the portable C build."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedserve.models import quantized as Q
from pagedserve.ops import native

# Where each format keeps float16 numbers (d, and dmin / m): random bytes there could be NaN.
F16_AT = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
          "Q6_K": [208]}
# The portable C build: baseline x86-64, no SIMD path (checks and sanitizer as the environment asks).
PORTABLE = tuple(native.build_flags("quant_linear", march="x86-64"))


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks of `fmt`: every code and scale bit pattern, with finite float16 fields."""
    rng = np.random.default_rng(seed)
    per, nbytes = Q.GGUF_FORMATS[fmt]
    blocks = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    for at in F16_AT[fmt]:
        d = (rng.standard_normal((rows, cols // per)) * 0.01).astype(np.float16)
        blocks[..., at:at + 2] = d.view(np.uint8).reshape(rows, cols // per, 2)
    return blocks.reshape(rows, -1)


def reference(fmt: str, blocks: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType[fmt]).reshape(rows, cols).copy())


@pytest.fixture(scope="module", params=["simd", "portable"])
def lib(request):
    lib = Q.load() if request.param == "simd" else Q.load(PORTABLE)
    assert lib is not None
    assert lib.quant_linear_simd() == (request.param == "simd")  # each build is the one it claims
    return lib


def cols_for(fmt: str) -> int:
    return 512 if fmt.endswith("_K") else 96  # K-quants: two super-blocks; others: three groups


@pytest.mark.parametrize("fmt", list(Q.GGUF_FORMATS))
def test_dequantized_weights_are_gguf_pys_bit_for_bit(fmt, lib):
    rows, cols = 37, cols_for(fmt)  # 37: a last panel of 5 rows
    blocks = random_blocks(fmt, rows, cols)
    ref = reference(fmt, blocks, rows, cols)
    unpacked = Q.from_gguf(fmt, blocks, rows, cols)
    assert np.array_equal(unpacked.dequantize(), ref.numpy())
    weight = Q.QuantizedWeight.of([unpacked], lib)
    assert torch.equal(weight.dequantize(), ref)
    ids = torch.tensor([36, 0, 17, 17])
    assert torch.equal(weight.rows(ids, torch.float32), ref[ids])
    assert torch.equal(weight.rows(ids, torch.bfloat16), ref[ids].to(torch.bfloat16))


@pytest.mark.parametrize("fmt", list(Q.GGUF_FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 70])  # in registers up to 4 rows, through a panel buffer above
def test_linear_matches_dequantize_then_matmul(fmt, rows, lib):
    n, cols = 37, cols_for(fmt)
    blocks = random_blocks(fmt, n, cols, seed=rows)
    w = reference(fmt, blocks, n, cols)
    weight = Q.QuantizedWeight.of([Q.from_gguf(fmt, blocks, n, cols)], lib)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    expected = (x.double() @ w.double().T).float()
    got = weight.linear(x)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    got_bf16 = weight.linear(x.to(torch.bfloat16))
    expected_bf16 = (x.to(torch.bfloat16).double() @ w.double().T).float()
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16.float(), expected_bf16, rtol=1e-2, atol=1e-2 * expected_bf16.abs().max().item())


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K"])
def test_a_rows_result_does_not_depend_on_the_batch(fmt, lib):
    n, cols = 50, cols_for(fmt)
    weight = Q.QuantizedWeight.of([Q.from_gguf(fmt, random_blocks(fmt, n, cols), n, cols)], lib)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([weight.linear(x[i:i + 1]) for i in range(len(x))])
    for size in (2, 4, 5, 6, 64, 70):
        assert torch.equal(weight.linear(x[:size]), alone[:size]), size


def test_a_fused_weight_holds_runs_of_different_formats(lib):
    cols = 256
    parts = [("Q4_K", 20), ("Q4_K", 12), ("Q6_K", 16), ("Q8_0", 5)]
    unpacked = [Q.from_gguf(f, random_blocks(f, r, cols, seed=i), r, cols) for i, (f, r) in enumerate(parts)]
    weight = Q.QuantizedWeight.of(unpacked, lib)
    assert weight.formats == ["Q4_K", "Q6_K", "Q8_0"]  # the two Q4_K parts share a segment
    dense = torch.from_numpy(np.concatenate([u.dequantize() for u in unpacked]))
    x = torch.randn(3, cols)
    torch.testing.assert_close(weight.linear(x), x @ dense.T, rtol=1e-5, atol=1e-4)
    bias = torch.randn(len(dense))
    torch.testing.assert_close(weight.linear(x, bias), x @ dense.T + bias, rtol=1e-5, atol=1e-4)


def test_an_embedding_row_id_out_of_range_is_an_index_error(lib):
    weight = Q.QuantizedWeight.of([Q.from_gguf("Q8_0", random_blocks("Q8_0", 20, 64), 20, 64)], lib)
    with pytest.raises(IndexError):
        weight.rows(torch.tensor([3, 20]), torch.float32)


def test_gguf_pys_own_quantizers_round_trip():
    """Blocks that gguf-py's quantizers wrote (real codes and scales, not random bytes)."""
    w = np.random.default_rng(2).standard_normal((48, 128)).astype(np.float32)
    for fmt in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        blocks = quantize(w, GGMLQuantizationType[fmt])
        unpacked = Q.from_gguf(fmt, blocks, 48, 128)
        assert np.array_equal(unpacked.dequantize(), dequantize(blocks, GGMLQuantizationType[fmt]).reshape(48, 128))


def test_int8_is_per_row_and_within_half_a_step():
    w = torch.randn(40, 96) * torch.linspace(0.01, 2, 40)[:, None]
    q = Q.quantize_int8(w)
    assert q.bits == 8 and q.mins is None and np.all(q.scales == q.scales[:, :1])
    error = np.abs(q.dequantize() - w.numpy())
    assert np.all(error <= q.scales[:, :1] * 0.5 + 1e-6 * np.abs(w.numpy()))
    weight = Q.QuantizedWeight.of([q])
    x = torch.randn(2, 96)
    torch.testing.assert_close(weight.linear(x), x @ torch.from_numpy(q.dequantize()).T, rtol=1e-5, atol=1e-5)


def test_int4_groups_of_32_within_half_a_step():
    w = torch.randn(20, 128)
    q = Q.quantize_int4(w)
    assert (q.bits, q.group) == (4, 32) and q.scales.shape == (20, 4)
    error = np.abs(q.dequantize() - w.numpy())
    assert np.all(error <= np.repeat(q.scales, 32, axis=1) * 0.5 + 1e-3)
    assert Q.QuantizedWeight.of([q]).segments[0].scale_f16  # float16 scales: Q4_1's bytes per weight


@pytest.mark.parametrize("method", [Q.quantize_int8, Q.quantize_int4])
def test_shapes_that_do_not_divide_into_groups_are_refused(method):
    with pytest.raises(ValueError, match="groups of 32"):
        method(torch.randn(8, 40))


def test_narrowing_cuts_rows_anywhere_and_columns_only_between_groups():
    q = Q.from_gguf("Q4_1", random_blocks("Q4_1", 10, 128), 10, 128)
    assert np.array_equal(q.narrow(0, 3, 4).dequantize(), q.dequantize()[3:7])
    assert np.array_equal(q.narrow(1, 64, 64).dequantize(), q.dequantize()[:, 64:])
    with pytest.raises(ValueError, match="cut through groups"):
        q.narrow(1, 16, 64)
