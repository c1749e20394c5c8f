"""The fp8 (e4m3) KV cache: one byte per element, a quarter of float32 and half of bfloat16.

Each layer's K and its V have one float32 scale each (per tensor): the cache holds x / scale,
rounded to e4m3 (3 mantissa bits, largest finite 448), and attention reads fp8 * scale. The
scales are 1.0 (vLLM's default) unless `calculate_kv_scales` sets them from the first real
forward pass: largest |x| of that step times CALIBRATION_HEADROOM, mapped onto 448, so later
steps may bring keys twice as large before they saturate (writes clamp to +-448).

torch has no CPU index_copy_ for fp8 (2.13), so the torch paths index a byte view of the cache
(`as_bytes`), the same memory, which every indexing op supports on every device.
"""

from __future__ import annotations

import torch
from torch import Tensor


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
CALIBRATION_HEADROOM = 2.0


def is_fp8(cache: Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def as_bytes(cache: Tensor) -> Tensor:
    """A view torch can index on every device: uint8 for an fp8 cache, the cache itself otherwise."""
    return cache.view(torch.uint8) if is_fp8(cache) else cache


def quantize(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale in e4m3 (round to nearest even, clamped to +-448: torch's cast saturates only
    from 2.12 on; before, values past 464 became NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: Tensor, dtype: torch.dtype, scale: Tensor) -> Tensor:
    """Cache contents as `dtype`: fp8 * scale, or x itself for an unquantized cache."""
    return (x.float() * scale).to(dtype) if x.dtype == FP8_DTYPE else x


def calibrated_scale(x: Tensor) -> Tensor:
    """A per-tensor scale that maps CALIBRATION_HEADROOM x max|x| onto e4m3's largest value."""
    return (x.abs().amax().float() * CALIBRATION_HEADROOM / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
