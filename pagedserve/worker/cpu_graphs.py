"""Decode steps on CPU, replayed in C from a recording of their kernel calls.

At a few rows, a decode step of a small model on CPU spends as long between its kernels as in
them: the eager forward of the embedded model makes 364 kernel calls through ctypes, each behind
module calls and torch's dispatcher, a few microseconds apiece, around kernels that are as short.
On the 2-core test machine a replayed step took 3.5-4.3 ms less than an eager one at 1 to 8
requests (docs/benchmarks.md, "Decode steps replayed in C"). As a CUDA graph does
(worker/cuda_graphs.py), a recording replays one forward's kernels with fixed addresses:
- the forward is run once on static buffers with every C kernel call noted (`native.recording`)
  and every torch operator watched: outside the kernels only allocations and views may run, since
  a replay skips everything else. A forward that does more (an fp8 cache, tensor parallelism, a
  weight without a C matmul) is not recorded, and its steps run eagerly;
- one recording serves every batch of up to `size` decodes: each kernel's row count is set at
  replay to the step's number of requests (every activation is row-major, so fewer rows are a
  prefix of each buffer);
- the intermediates the forward allocated are laid out again in one arena, where a buffer reuses
  the memory of those whose last reader has run (the replay runs the calls in order);
- before each replay the step's inputs are copied into the static buffers (block tables as wide
  as max_model_len needs); the output is read before the next replay overwrites it.
csrc/replay.c runs the calls. Results are the eager forward's bit for bit: the same kernels on
the same values.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from pagedserve.attention.kv_cache import KVCache
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.ops import native

# The kernels a recording may hold: name -> (csrc/replay.c's kind, which integer argument is the
# row count). A call's arguments split into integers (pointers included) and floats, each in order.
KINDS = {"linear": (0, 1), "rms_norm": (1, 4), "act_and_mul": (2, 2), "rotary": (3, 3),
         "paged_decode_attention": (4, 7), "gather_rows": (5, 4), "scatter_rows": (6, 5), "quant_linear": (7, 1),
         "quant_rows": (8, 4), "lora_add": (9, 1), "gather_scaled_rows": (10, 4)}
MAX_INTS, MAX_FLOATS = 20, 3
ALIGN = 64  # bytes: each intermediate's place in the arena, as torch aligns its allocations


class Call(ctypes.Structure):
    """csrc/replay.c's call_t."""

    _fields_ = [("kind", ctypes.c_int64), ("rows_at", ctypes.c_int64), ("fn", ctypes.c_void_p),
                ("ints", ctypes.c_int64 * MAX_INTS), ("floats", ctypes.c_float * MAX_FLOATS)]


@functools.cache
def load() -> ctypes.CDLL | None:
    lib = native.optional_library("replay", "decode steps run eagerly")
    if lib is None:
        return None
    lib.replay.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.replay.restype = ctypes.c_int64
    return lib


class NotRecordable(Exception):
    """The forward does something a replay would skip."""


_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default,
                torch.ops.aten.empty_like.default}


class _Watch(TorchDispatchMode):
    """Lets through allocations (kept, for the arena) and operators that only make views: any
    other operator writes or reads values that a replay would not see again."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[Tensor] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo.disable unless told not to, and that
        # imports torch._dynamo (0.65 s of a warm start here); a recording is never compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocations.append(out)
            return out
        try:
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, Tensor)}
        except NotImplementedError:  # a oneDNN-packed weight (no C matmul for this CPU) has no storage
            raise NotRecordable(f"{func} runs outside the C kernels") from None
        outputs = out if isinstance(out, (tuple, list)) else [out]
        if func._schema.is_mutable or not all(
                isinstance(o, Tensor) and o.untyped_storage().data_ptr() in inputs for o in outputs):
            raise NotRecordable(f"{func} runs outside the C kernels")
        return out


class CpuDecodeGraph:
    """Replays the decode forward of up to `size` requests (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], size: int, max_blocks: int,
                 block_size: int, backend, layer_groups: list[int] | None = None) -> None:
        """kv_caches: each layer's; layer_groups: each layer's KV cache group (default: one group),
        whose slots and block tables the replay reads from buffers of their own."""
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.size, self.block_size = size, block_size
        self.layer_groups = layer_groups
        num_groups = 1 + max(layer_groups) if layer_groups else 1
        self.input_ids = torch.zeros(size, dtype=torch.int64)
        self.positions = torch.zeros(size, dtype=torch.int64)
        self.slot_mapping = torch.zeros((num_groups, size), dtype=torch.int64)
        self.block_tables = torch.zeros((num_groups, size, max_blocks), dtype=torch.int64)
        self.seq_lens = torch.ones(size, dtype=torch.int64)
        # Kept: the calls point into their tensors (the decode rows' indices among them).
        self.mds = self._static_metadata(size)
        # Recording runs the forward, which writes K/V into slot 0: block 0's contents are put back.
        saved = [(c.k[0].clone(), c.v[0].clone()) for c in kv_caches]
        try:
            self.calls, self.output, self.arena, self.intermediate_bytes = record(self._forward, size)
        finally:
            for c, (k, v) in zip(kv_caches, saved):
                c.k[0], c.v[0] = k, v
        # The calls read the weights' packed copies as they were: a weight written or swapped since
        # (its copies remade on the eager path) ends the replays.
        self.params = list(model.parameters())
        self.weights = self._weights()

    def _static_metadata(self, rows: int) -> list[AttentionMetadata]:
        """Each group's metadata over the first `rows` rows of the static buffers."""
        return [self.backend.static_decode_metadata(slots[:rows], self.positions[:rows], tables[:rows],
                                                    self.seq_lens[:rows], self.block_size)
                for slots, tables in zip(self.slot_mapping, self.block_tables)]

    def _forward(self, rows: int) -> Tensor:
        """The eager forward of the first `rows` requests of the static buffers."""
        mds = self.mds if rows == self.size else self._static_metadata(rows)
        md = [mds[g] for g in self.layer_groups] if self.layer_groups else mds[0]
        return self.model(self.input_ids[:rows], self.positions[:rows], self.kv_caches, md)

    def _weights(self) -> list[tuple[int, int]]:
        return [(p.data_ptr(), p._version) for p in self.params]

    @classmethod
    def build(cls, *args, **kwargs) -> CpuDecodeGraph | None:
        """The graph, or None where the forward cannot be recorded (or the replay library is not built)."""
        graph = cls.attempt(*args, **kwargs)
        return graph if isinstance(graph, CpuDecodeGraph) else None

    @classmethod
    def attempt(cls, *args, **kwargs) -> CpuDecodeGraph | str:
        """The graph, or why there is none: the replay library is not built, or the forward does work
        that a replay would skip."""
        if load() is None:
            return native.unavailable_reason("replay") or "the replay library is not loaded"
        try:
            return cls(*args, **kwargs)
        except NotRecordable as e:
            return f"the forward does work outside the C kernels: {e}"

    def can_run(self, mds: AttentionMetadata | list[AttentionMetadata]) -> bool:
        """Whether this step (each group's metadata) is decodes only, few enough, with tables that
        fit the buffers."""
        md = mds[0] if isinstance(mds, list) else mds
        return (md.max_query_len == 1 and md.num_reqs <= self.size
                and md.block_tables.shape[1] <= self.block_tables.shape[2] and self._weights() == self.weights)

    def run(self, input_ids: Tensor, mds: AttentionMetadata | list[AttentionMetadata]) -> Tensor:
        """The forward's hidden states [n, hidden] of a step that `can_run`; valid until the next run."""
        mds = mds if isinstance(mds, list) else [mds]
        n, width = mds[0].num_reqs, mds[0].block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = mds[0].positions
        self.seq_lens[:n] = mds[0].seq_lens
        for g, md in enumerate(mds):
            self.slot_mapping[g, :n] = md.slot_mapping
            self.block_tables[g, :n, :width] = md.block_tables  # columns past width: stale, never read
        failed = load().replay(ctypes.addressof(self.calls), len(self.calls), n)
        if failed:
            kind = next(name for name, (k, _) in KINDS.items() if k == self.calls[failed - 1].kind)
            raise RuntimeError(f"replayed decode step: call {failed - 1} ({kind}) failed: a row index out of "
                               "range, a block id outside the pool (a checked build), a LoRA slot outside the "
                               "model's, or no memory for a kernel's scratch space")
        return self.output[:n]


def record(forward: Callable[[int], Tensor], size: int) -> tuple[ctypes.Array, Tensor, Tensor, int]:
    """Record `forward(size)`, the forward over `size` rows: (the calls, re-pointed into one arena;
    its output, a view of the arena; the arena, which must live as long as the calls; the bytes the
    forward's intermediates took before they shared it). NotRecordable if a replay could not
    reproduce it."""
    with torch.inference_mode():
        forward(1)  # one row eagerly first: weights are packed and libraries loaded on first use
        watch = _Watch()
        with watch, native.recording() as noted:
            out = forward(size)
    if not noted:
        raise NotRecordable("the forward calls no kernel")
    calls = []
    for fn, args in noted:
        if fn.__name__ not in KINDS:
            raise NotRecordable(f"{fn.__name__} cannot be replayed")
        kind, rows_at = KINDS[fn.__name__]
        ints = [a or 0 for a in args if not isinstance(a, float)]
        floats = [a for a in args if isinstance(a, float)]
        if ints[rows_at] != size:
            raise NotRecordable(f"{fn.__name__} ran {ints[rows_at]} rows, not the step's {size}")
        calls.append((kind, rows_at, ctypes.cast(fn, ctypes.c_void_p).value, ints, floats,
                      [t is ctypes.c_void_p for t in fn.argtypes if t is not ctypes.c_float]))
    arena, moved = _plan(watch.allocations, calls, out)
    table = (Call * len(calls))()
    for slot, (kind, rows_at, fn, ints, floats, pointers) in zip(table, calls):
        slot.kind, slot.rows_at, slot.fn = kind, rows_at, fn
        slot.ints[:len(ints)] = [moved(v) if p else v for v, p in zip(ints, pointers)]
        slot.floats[:len(floats)] = floats
    start = moved(out.data_ptr()) - arena.data_ptr()
    intermediate_bytes = sum(t.untyped_storage().nbytes() for t in watch.allocations)
    return table, arena[start : start + out.nbytes].view(out.dtype).view(out.shape), arena, intermediate_bytes


def _plan(allocations: list[Tensor], calls: list, out: Tensor) -> tuple[Tensor, Callable[[int], int]]:
    """Place the forward's intermediates in one arena: each at the lowest offset free of those
    whose lives (first to last call that points into them) overlap its own; the output lives to
    the end. Returns the arena and the map from a recorded address to its place there."""
    storages = sorted({(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in allocations})
    starts = [start for start, _ in storages]

    def owner(address: int) -> int | None:
        """The index of the allocation that holds `address`, if one does."""
        i = bisect.bisect_right(starts, address) - 1
        return i if i >= 0 and address < starts[i] + storages[i][1] else None

    lives: dict[int, list[int]] = {}  # allocation -> [first call, last call] that points into it
    for c, (*_, ints, _, pointers) in enumerate(calls):
        for v, is_pointer in zip(ints, pointers):
            if is_pointer and (i := owner(v)) is not None:
                lives.setdefault(i, [c, c])[1] = c
    if (i := owner(out.data_ptr())) not in lives:
        raise NotRecordable("the forward's output is not written by its kernels")
    lives[i][1] = len(calls)
    placed: list[tuple[int, int, int, int]] = []  # (offset, bytes, first, last)
    offsets: dict[int, int] = {}
    for i, (first, last) in sorted(lives.items(), key=lambda kv: (kv[1][0], -storages[kv[0]][1])):
        offset, nbytes = 0, -(-storages[i][1] // ALIGN) * ALIGN
        for o, b, _, _ in sorted(p for p in placed if p[2] <= last and first <= p[3]):
            if offset + nbytes <= o:
                break
            offset = max(offset, o + b)
        placed.append((offset, nbytes, first, last))
        offsets[i] = offset
    arena = torch.empty(max((o + b for o, b, *_ in placed), default=0), dtype=torch.uint8)

    def moved(address: int) -> int:
        i = owner(address)
        return address if i not in offsets else arena.data_ptr() + offsets[i] + address - starts[i]

    return arena, moved
