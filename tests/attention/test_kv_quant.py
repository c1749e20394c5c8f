"""The fp8 KV cache: the rounding and scales of kv_quant, and every backend reading and writing an
fp8 cache exactly as the oracle does (the Triton kernels under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention import kv_quant, sdpa, torch_ref, triton_paged
from pagedserve.attention.kv_quant import FP8_DTYPE, quantize
from pagedserve.config import resolve_kv_cache_dtype
from pagedserve.ops import cpu_attention
from tests.attention.test_triton_paged import mixed_step


def test_cache_dtype_names():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32) == FP8_DTYPE
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == FP8_DTYPE
    assert resolve_kv_cache_dtype("float32", torch.float32) == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("int4", torch.float32)
    with pytest.raises(ValueError, match="differs from the model's dtype"):  # the K/V written are the model's
        resolve_kv_cache_dtype("float16", torch.float32)


def test_rounding_error_and_saturation():
    gen = torch.Generator().manual_seed(0)
    magnitudes = 2.0 ** (torch.rand(10_000, generator=gen) * 24 - 14)  # 2^-14 .. 2^10: all of e4m3 and beyond
    x = magnitudes * torch.randn(10_000, generator=gen).sign()
    scale = torch.tensor(0.25)
    back = kv_quant.dequantize(quantize(x, scale), torch.float32, scale)
    scaled = (x / scale).abs()
    normal = (scaled >= 2**-6) & (scaled <= 448)  # e4m3's normal range; 3 mantissa bits: error <= 2^-4 relative
    assert normal.sum() > 5000 and (scaled > 448).any() and (scaled < 2**-6).any()
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-7)[normal].all()
    assert ((back - x).abs() <= 2**-10 * scale)[scaled < 2**-6].all()  # subnormal spacing 2^-9, half of it
    assert (back.abs() == 448 * scale)[scaled > 448].all()  # saturates, never inf or NaN
    big = torch.tensor([1e4, -1e4])
    assert kv_quant.dequantize(quantize(big, scale), torch.float32, scale).tolist() == [448 * 0.25, -448 * 0.25]


def test_calibrated_scale_leaves_headroom():
    x = torch.tensor([[-3.0, 1.5], [0.5, 2.0]])
    assert kv_quant.calibrated_scale(x).item() == pytest.approx(3.0 * kv_quant.CALIBRATION_HEADROOM / 448)
    assert kv_quant.calibrated_scale(torch.zeros(3)).item() > 0  # never divides by zero


def fp8_step(scales: torch.Tensor, seed: int = 0, backend: str = "torch"):
    """The mixed step of test_triton_paged with its caches quantized to fp8 (metadata for `backend`)."""
    q, k, v, k_cache, v_cache, md = mixed_step(16, 2, 3, 64, seed=seed, backend=backend)
    return q, k, v, quantize(k_cache, scales[0]), quantize(v_cache, scales[1]), md


SCALES = torch.tensor([0.02, 0.01])


def test_oracle_on_fp8_stays_close_to_float32():
    q, k, v, k8, v8, md = fp8_step(SCALES)
    k32, v32 = kv_quant.dequantize(k8, torch.float32, SCALES[0]), kv_quant.dequantize(v8, torch.float32, SCALES[1])
    out = torch_ref.paged_attention(q, k, v, k8, v8, md, 0.125, kv_scales=SCALES)
    exact = torch_ref.paged_attention(q, k, v, k32, v32, md, 0.125)
    # Outputs mix V rows, each within 2^-4 of its value after rounding (the step's own K/V were
    # rounded on the way in; the cached ones already were); K's rounding moves the weights a little.
    assert (out - exact).abs().max().item() < 2**-4 * v.abs().max().item()
    rows = md.slot_mapping
    assert torch.equal(k8.view(-1, 2, 64)[rows].view(torch.uint8), quantize(k, SCALES[0]).view(torch.uint8))


@pytest.mark.parametrize("sinks", [None, torch.tensor([-3.0, 0.5, 2.0, -1.0, 25.0, -25.0])])
@pytest.mark.parametrize("path", ["c-kernel", "sdpa-groups", "triton", "triton-split"])
def test_backends_read_and_write_fp8_as_the_oracle(path, monkeypatch, sinks):
    if path == "sdpa-groups":  # the fallback when the C kernel cannot run
        monkeypatch.setattr(cpu_attention, "supports", lambda q, k_cache: False)
    if path == "triton-split":  # decodes split over parts of 16 tokens, then merged
        monkeypatch.setattr(triton_paged, "PARTITION_TOKENS", 16)
        monkeypatch.setattr(triton_paged, "SPLIT_BELOW_PROGRAMS", 1000)
    module = triton_paged if path.startswith("triton") else sdpa
    q, k, v, k8, v8, md = fp8_step(SCALES, seed=1, backend="triton" if module is triton_paged else "torch")
    ref_k, ref_v = k8.clone(), v8.clone()
    expected = torch_ref.paged_attention(q, k, v, ref_k, ref_v, md, 0.125, 6, SCALES, sinks)
    out = module.paged_attention(q, k, v, k8, v8, md, 0.125, 6, SCALES, sinks)
    assert torch.equal(k8.view(torch.uint8), ref_k.view(torch.uint8))  # same rounding as torch's cast
    assert torch.equal(v8.view(torch.uint8), ref_v.view(torch.uint8))
    assert (out - expected).abs().max().item() < 1e-4


def test_triton_quantize_rounds_as_torch_bit_for_bit():
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_kernel(X, Y, S, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, triton_paged._quantize(tl.load(X + i), tl.load(S), Y.dtype.element_ty))

    gen = torch.Generator().manual_seed(0)
    n = 1 << 14  # magnitudes 2^-18 .. 2^12: zero, subnormal, normal, saturating; both signs
    x = 2.0 ** (torch.rand(n, generator=gen) * 30 - 18) * torch.randn(n, generator=gen).sign()
    x[:8] = torch.tensor([0.0, -0.0, 31.9, 448, 449, 470, 1e9, -0.0155])  # carries into the exponent, ties
    out = torch.empty(n, dtype=FP8_DTYPE)
    scale = torch.tensor([0.5])
    quantize_kernel[(1,)](x, out, scale, N=n)
    assert torch.equal(out.view(torch.uint8), quantize(x, scale[0]).view(torch.uint8))
