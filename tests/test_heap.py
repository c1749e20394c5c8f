"""heap.keep_freed_memory: blocks of a step's size, freed together, stay in the heap, so the next
step reuses their pages. With glibc's defaults the freed top of the heap goes back to the kernel
and every step faults its pages in (and zeroes them) again. Measured with malloc itself, in a
process of its own, so that no other allocation lands between the blocks."""

import subprocess
import sys

import pytest

CHILD = """
import ctypes, resource, sys
from pagedserve import heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[1] == "keep":
    assert heap.keep_freed_memory()
SIZE = 24 << 20  # a 2,048-token prompt step's gate_up in float32

def step():  # three temporaries alive together, written, then freed
    blocks = [libc.malloc(SIZE) for _ in range(3)]
    for b in blocks:
        libc.memset(b, 1, SIZE)
    for b in reversed(blocks):
        libc.free(b)

for _ in range(2):  # the first steps set glibc's adaptive thresholds and grow the heap
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_of_a_step_are_reused_not_faulted_in_again():
    pages_per_step = 3 * (24 << 20) // 4096
    default, kept = faults("default"), faults("keep")
    assert default >= 2 * pages_per_step, default  # the defaults: most pages of every step fresh again
    assert kept < pages_per_step // 20, kept
