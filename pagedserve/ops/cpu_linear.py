"""Matmuls of a few rows on CPU (csrc/linear.c): the linears of decode steps.

`layers.linear` sends x @ W.T here when x has at most MAX_ROWS rows, and to oneDNN's packed GEMM
above that, where oneDNN is faster; every row count where oneDNN has no fast path for the dtype
(bfloat16 on a CPU without bfloat16 instructions, where torch's fallback is several times slower
than this kernel). The weight is read through its own copy in the kernel's panel layout (`pack`),
made once per weight. The kernel needs AVX-512 or AVX2 with FMA; bfloat16 also an even number of
input features, and on AVX-512 its BF16 dot products (on AVX2 the weights widen to float32 in
registers). `supports` says whether a matmul can take this path.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve.ops import native

# Above this many rows oneDNN's GEMM is as fast or faster (docs/benchmarks.md: over the model's
# matmuls float32 crossed over between 128 and 192 rows; bfloat16 was still 1.05x faster here at 192,
# but per layer at 512 rows oneDNN was 1.15x faster).
MAX_ROWS = 128
PANEL = 64  # output columns per panel, as in csrc/linear.c
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def load() -> ctypes.CDLL | None:
    lib = native.optional_library("linear", "few-row matmuls run in oneDNN")
    if lib is None:
        return None
    lib.linear_supports.argtypes = [ctypes.c_int]
    lib.linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.linear.restype = None
    return lib


@functools.cache
def _dtype_supported(dtype: torch.dtype) -> bool:
    lib = load()
    return lib is not None and dtype in _DTYPES and bool(lib.linear_supports(_DTYPES[dtype]))


def supports_dtype(dtype: torch.dtype) -> bool:
    """Whether the kernel is built here and this CPU has the instructions it computes `dtype` with."""
    return _dtype_supported(dtype)


def supports(x: Tensor, weight: Tensor, max_rows: int | None = MAX_ROWS) -> bool:
    """Whether x @ weight.T can run here; max_rows None: at any number of rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.device.type == "cpu" and x.dtype == weight.dtype and 0 < rows <= (max_rows or rows)
            and x.shape[-1] == weight.shape[1] and (x.dtype == torch.float32 or weight.shape[1] % 2 == 0)
            and supports_dtype(x.dtype))


def pack(weight: Tensor) -> Tensor:
    """W [n, k] -> [panels, steps, 64, per_step]: 64 output columns per panel (zeros past n), and
    per step one k (float32) or a pair of consecutive k (bfloat16)."""
    n, k = weight.shape
    per_step = 1 if weight.dtype == torch.float32 else 2
    panels = -(-n // PANEL)
    padded = F.pad(weight.detach(), (0, 0, 0, panels * PANEL - n))
    return padded.view(panels, PANEL, k // per_step, per_step).transpose(1, 2).contiguous()


def linear(x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None = None) -> Tensor:
    """x @ W.T (+ bias), given W's `pack`, for any x and W that `supports` accepts."""
    x, bias = x.contiguous(), None if bias is None else bias.contiguous()  # held: the kernel reads them
    k = x.shape[-1]
    y = x.new_empty((*x.shape[:-1], out_features))
    native.call(load().linear, x.data_ptr(), x.numel() // k, k, packed.data_ptr(),
                None if bias is None else bias.data_ptr(), y.data_ptr(), out_features, _DTYPES[x.dtype],
                torch.get_num_threads())
    return y
