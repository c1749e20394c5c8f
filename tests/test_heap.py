"""heap.keep_freed_memory: blocks of a step's size, freed together, stay in the heap, so the next
step reuses their pages. With glibc's defaults the freed top of the heap goes back to the kernel
and every step faults its pages in (and zeroes them) again. Measured with malloc itself, in a
process of its own, so that no other allocation lands between the blocks.

heap.freeze_startup_objects: garbage made before it is collected, what is alive is frozen (and so
never collected), in a process of its own: frozen objects of the test process would never go.
The servers' calls are checked where they run: tests/engine/test_async_llm.py (the core process)
and tests/entrypoints/openai/test_api_server.py (`pagedserve serve`)."""

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


FREEZE_CHILD = """
import gc, weakref
from pagedserve import heap

class Node:
    pass

garbage = Node(); garbage.me = garbage  # a cycle: only the collector frees it
dead = weakref.ref(garbage)
kept = Node(); kept.me = kept
alive = weakref.ref(kept)
del garbage
frozen = heap.freeze_startup_objects()
assert dead() is None, "garbage from before the freeze was frozen with the rest"
assert frozen == gc.get_freeze_count() > 1000, frozen
del kept  # garbage now, but frozen: no collection looks at it
gc.collect()
assert alive() is not None, "a frozen object was collected"
print("ok")
"""


def test_freezing_collects_garbage_first_then_leaves_what_lived_out_of_every_collection():
    result = subprocess.run([sys.executable, "-c", FREEZE_CHILD], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
