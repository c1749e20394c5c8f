"""The decoder's elementwise steps as one C pass each on CPU (csrc/fused_ops.c): RMSNorm (Llama's or
Gemma's (1 + weight) form) with its residual add, or over the heads of q or k in place; the gated
activation (SiLU or tanh-approximated GELU) times up; rotary embedding in place; a scaled embedding
lookup.

Torch runs each as 5 to 14 operators, each a pass over memory and a dispatch from Python; per
layer and step that is ~35 operators the C versions replace with 4 calls. The results are torch's
arithmetic (`models/layers.py`'s torch path, which tests hold them against), up to the order of
the RMSNorm sum and an ulp of exp in the activations. `available(x)` says whether a tensor can
take this path: float32 or bfloat16, on CPU, with the library built (`ops/native.py`);
PAGEDSERVE_CPU_KERNEL=0 turns it off with the decode kernel.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from pagedserve.ops import native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def load() -> ctypes.CDLL | None:
    lib = native.optional_library("fused_ops", "norms, activations and RoPE run in torch")
    if lib is None:
        return None
    ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.rms_norm.argtypes = [ptr] * 4 + [i64, i64, ctypes.c_float, i64, i64, c_int, c_int, c_int]
    lib.act_and_mul.argtypes = [ptr, ptr, i64, i64, c_int, c_int, c_int]
    lib.rotary.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, c_int, c_int]
    lib.gather_rows.argtypes = [ptr, i64, ptr, ptr, i64, i64, c_int]
    lib.scatter_rows.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, c_int]
    lib.gather_scaled_rows.argtypes = [ptr, i64, ptr, ptr, i64, i64, ctypes.c_float, c_int, c_int]
    for fn in (lib.rms_norm, lib.act_and_mul, lib.rotary):
        fn.restype = None
    lib.gather_rows.restype = lib.scatter_rows.restype = lib.gather_scaled_rows.restype = c_int
    return lib


def available(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and load() is not None


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None,
             unit_offset: bool = False) -> Tensor:
    """RMSNorm of x's rows ([..., dim], contiguous); with `residual`, of x + residual, which is
    also written into residual (in place). unit_offset: scale by (1 + weight) in float32, as Gemma
    does, rather than by weight after rounding to the dtype."""
    dim = x.shape[-1]
    out = torch.empty_like(x)
    native.call(load().rms_norm, x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                out.data_ptr(), x.numel() // dim, dim, eps, 1, dim, int(unit_offset), _DTYPES[x.dtype],
                torch.get_num_threads())
    return out


def rms_norm_heads_(x: Tensor, weight: Tensor, eps: float, unit_offset: bool = False) -> Tensor:
    """RMSNorm of each head of x [num_tokens, heads, head_dim] in place (heads contiguous within a
    token; tokens may be further apart, as in a view of the fused qkv output): the q/k norms."""
    n, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim
    native.call(load().rms_norm, x.data_ptr(), None, weight.data_ptr(), x.data_ptr(), n, head_dim, eps, heads,
                x.stride(0), int(unit_offset), _DTYPES[x.dtype], torch.get_num_threads())
    return x


ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # csrc/fused_ops.c's ACT_* (transformers' names)


def act_and_mul(gate_up: Tensor, activation: str = "silu") -> Tensor:
    """act(gate) * up for gate_up = [..., gate | up] (contiguous); act one of ACTIVATIONS: SiLU,
    or torch's GELU with the tanh approximation."""
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    native.call(load().act_and_mul, gate_up.data_ptr(), out.data_ptr(), out.numel() // inter, inter,
                ACTIVATIONS[activation], _DTYPES[gate_up.dtype], torch.get_num_threads())
    return out


def rotary_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [num_tokens, heads, head_dim] in place (heads contiguous within a token; tokens
    may be further apart, as in a view of the fused qkv output) by cos, sin [num_tokens,
    rotary_dim / 2] (contiguous, x's dtype): the first rotary_dim dims of each head, all of them
    or a partial rotary's share."""
    n, heads, head_dim = x.shape
    rotary_dim = 2 * cos.shape[-1]
    assert x.stride(2) == 1 and x.stride(1) == head_dim and cos.is_contiguous() and sin.is_contiguous()
    assert rotary_dim <= head_dim and cos.shape == sin.shape == (n, rotary_dim // 2)
    native.call(load().rotary, x.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, x.stride(0), heads, head_dim,
                rotary_dim, _DTYPES[x.dtype], torch.get_num_threads())
    return x


def gather_rows(src: Tensor, rows: Tensor) -> Tensor:
    """src[rows] for src [num_rows, ...] (contiguous) and rows [n] int64 (contiguous): an
    embedding lookup, a table's rows at the step's positions. IndexError for a row outside src."""
    out = src.new_empty((rows.shape[0], *src.shape[1:]))
    if native.call(load().gather_rows, src.data_ptr(), src.shape[0], rows.data_ptr(), out.data_ptr(), rows.shape[0],
                   src[0].nbytes, torch.get_num_threads()):
        raise IndexError(f"a row index is outside [0, {src.shape[0]})")
    return out


def scatter_rows_(dst: Tensor, rows: Tensor, src: Tensor) -> None:
    """dst[rows] = src, in place, for dst [num_rows, ...] (contiguous), rows [n] int64 (contiguous)
    and src [n, ...] whose rows may lie apart but are each contiguous (a view of the fused qkv
    output's K or V). IndexError for a row outside dst, and then nothing is written."""
    assert src.dtype == dst.dtype and src.shape[1:] == dst.shape[1:] and src[0:1].is_contiguous()
    if native.call(load().scatter_rows, src.data_ptr(), src.stride(0) * src.element_size(), rows.data_ptr(),
                   dst.data_ptr(), dst.shape[0], rows.shape[0], dst[0].nbytes, torch.get_num_threads()):
        raise IndexError(f"a row index is outside [0, {dst.shape[0]})")


def gather_scaled_rows(src: Tensor, rows: Tensor, scale: float) -> Tensor:
    """src[rows] * scale for src [num_rows, dim] (contiguous, float32 or bfloat16) and rows [n]
    int64 (contiguous), each product rounded to src's dtype; `scale` must be a value of that dtype
    (torch multiplies by the scale rounded to it). IndexError for a row outside src."""
    out = src.new_empty((rows.shape[0], src.shape[1]))
    if native.call(load().gather_scaled_rows, src.data_ptr(), src.shape[0], rows.data_ptr(), out.data_ptr(),
                   rows.shape[0], src.shape[1], scale, _DTYPES[src.dtype], torch.get_num_threads()):
        raise IndexError(f"a row index is outside [0, {src.shape[0]})")
    return out
