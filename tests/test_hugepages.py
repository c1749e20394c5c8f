"""hugepages.zeros: a zero tensor like torch.zeros, whose memory, when it spans a huge page, is
aligned to 2 MiB, carries the kernel's huge-page advice (VmFlags `hg` in /proc/self/smaps), and is
resident only where it has been touched."""

from __future__ import annotations

import sys

import pytest
import torch

from pagedserve import hugepages


def mapping_fields(address: int) -> dict[str, list[str]] | None:
    """The /proc/self/smaps fields (Rss, VmFlags...) of the mapping that holds `address`; None if
    nothing is mapped there."""
    fields = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                if fields is not None:
                    return fields
                start, end = (int(x, 16) for x in head.split("-"))
                fields = {} if start <= address < end else None
            elif fields is not None:
                fields[line.split(":")[0]] = line.split()[1:]
    return fields


def vm_flags(address: int) -> list[str]:
    return mapping_fields(address)["VmFlags"]


def resident_kib(address: int) -> int:
    return int(mapping_fields(address)["Rss"][0])


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_a_large_tensor_is_resident_only_where_touched_and_unmapped_when_freed():
    t = hugepages.zeros((64, 1024, 1024), torch.float32)  # 256 MiB: a warm start no longer writes it
    address = t.data_ptr()
    assert resident_kib(address) < 4 << 10
    t[3].fill_(1.0)  # 4 MiB
    assert 4 << 10 <= resident_kib(address) < 16 << 10
    assert t.sum().item() == 1024 * 1024 and not t[4:].any()  # reading the untouched rest: zeros
    del t
    assert mapping_fields(address) is None
