"""CUDA graphs for decode steps.

A decode step of a small model on a GPU is bound by launching its kernels (a few hundred per
forward), not by running them. A CUDA graph records one forward's launches once and replays them
with a single call. A graph replays fixed shapes and fixed addresses, so:
- graphs are captured at a set of batch sizes (CAPTURE_SIZES, up to max_num_seqs); a step of n
  decodes runs the graph of the next size up, its extra rows padded: slot -1 (the KV write skips
  it), context length 1 (one key, from whatever block a stale table row names), outputs dropped;
- the step's inputs are copied into static buffers that every graph reads (block tables as wide
  as max_model_len needs), and each graph's output is a static tensor, read after the replay;
- only the forward is captured (embedding to final norm); the LM head and sampling run eagerly
  on the n real rows;
- the attention backend must not read the step's host-side values (the SDPA path groups decodes
  by length on the host), so graphs are used with the Triton backend only, whose metadata over
  the static buffers (`TritonBackend.static_decode_metadata`) serves every replay. Each layer's
  fp8 scales are device tensors read at replay, so calibrating them after capture is seen.

The same class with capture=False runs the padded forward eagerly: tests check on the CPU (Triton
interpreter) that padding changes no real row's result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pagedserve.attention.kv_cache import KVCache
from pagedserve.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagedserve.attention.triton_paged import TritonBackend

CAPTURE_SIZES = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: CAPTURE_SIZES up to the first that holds max_num_seqs."""
    sizes = [s for s in CAPTURE_SIZES if s < max_num_seqs]
    return sizes + [next((s for s in CAPTURE_SIZES if s >= max_num_seqs), max_num_seqs)]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], sizes: list[int], max_blocks: int,
                 block_size: int, backend: TritonBackend, device: torch.device, capture: bool = True) -> None:
        self.model, self.kv_caches, self.block_size, self.backend = model, kv_caches, block_size, backend
        self.sizes = sorted(sizes)
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((largest, max_blocks), dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        if capture:
            self._capture_all()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def can_run(self, md: AttentionMetadata) -> bool:
        """Whether this step is decodes only, few enough, with tables that fit the buffers."""
        return (md.max_query_len == 1 and md.num_reqs <= self.max_batch
                and md.block_tables.shape[1] <= self.block_tables.shape[1])

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata whose tensors are views of the static buffers: size one-token requests."""
        return self.backend.static_decode_metadata(self.slot_mapping[:size], self.positions[:size],
                                                   self.block_tables[:size], self.seq_lens[:size], self.block_size)

    def _forward(self, size: int) -> Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            self._forward(size)  # warm-up outside the graph: compiles the kernels, sets up the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: Tensor, md: AttentionMetadata) -> Tensor:
        """The forward's hidden states [n, hidden] of a step that `can_run`."""
        n = md.num_reqs
        size = self.padded_size(n)
        width = md.block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = md.positions
        self.slot_mapping[:n] = md.slot_mapping
        self.slot_mapping[n:size] = -1
        self.block_tables[:n, :width] = md.block_tables  # columns past width: stale, never read (past seq_len)
        self.seq_lens[:n] = md.seq_lens
        self.seq_lens[n:size] = 1
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]
