"""The batched LoRA delta on CPU (csrc/lora.c): one call per fused linear adds, to each row of its
output, the low-rank update of the adapter in that row's slot.

The weights are in the kernel's layout (see csrc/lora.c), which `lora/layers.py`'s LoRAStack keeps:
A transposed [slots, parts, in_features, R], B transposed [slots, R, out_total], the rank each slot
uses in each part [slots, parts] (0: a part it does not touch), R a multiple of RANK_MULTIPLE.
`available(device, dtype)` says whether a stack can take this path: CPU, float32 or bfloat16, the
library built (PAGEDSERVE_CPU_KERNEL=0 turns it off with the other kernels).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from pagedserve.ops import native

RANK_MULTIPLE = 16  # csrc/lora.c's LANES: the rank dimension of its weights is a multiple of it
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def load() -> ctypes.CDLL | None:
    lib = native.optional_library("lora", "LoRA deltas run in torch")
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.lora_add.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_int,
                             ctypes.c_int]
    lib.lora_add.restype = ctypes.c_int
    return lib


def available(device: torch.device | str, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype in _DTYPES and load() is not None


def lora_add(x: Tensor, out: Tensor, slots: Tensor, at: Tensor, bt: Tensor, ranks: Tensor, part_ends: Tensor) -> None:
    """out[r] += the delta of slot slots[r] for each row r of x [rows, in] (contiguous), in place; out
    [rows, out_total] with contiguous rows; slots [>= rows] int64, -1 for a row left as it is.
    ValueError for a slot outside [-1, slots of the stack)."""
    rows, in_features = x.shape
    num_slots, parts, _, rank_dim = at.shape
    failed = native.call(load().lora_add, x.data_ptr(), rows, in_features, out.data_ptr(), out.stride(0),
                         slots.data_ptr(), num_slots, at.data_ptr(), bt.data_ptr(), ranks.data_ptr(),
                         part_ends.data_ptr(), parts, rank_dim, _DTYPES[x.dtype], torch.get_num_threads())
    if failed == 1:
        raise ValueError(f"a row's LoRA slot is outside [-1, {num_slots})")
    if failed:
        raise MemoryError("no memory for the LoRA kernel's row order")
