"""hugepages.zeros: a zero tensor like torch.zeros, whose memory, when it spans a huge page, is
aligned to 2 MiB and carries the kernel's huge-page advice (VmFlags `hg` in /proc/self/smaps)."""

from __future__ import annotations

import sys

import pytest
import torch

from pagedserve import hugepages


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address`."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise LookupError(hex(address))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeros_is_torch_zeros(dtype):
    for shape in [(3, 4), (700, 16, 3, 64)]:
        t = hugepages.zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.view(torch.uint8).any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_a_large_tensor_is_aligned_and_advised():
    t = hugepages.zeros((1024, 16, 3, 64), torch.float32)  # 12 MiB
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert "hg" in vm_flags(t.data_ptr())
