"""Paged attention: per-step metadata and the backends that read K/V through block tables.

Every backend has the contract of `torch_ref.paged_attention`; a step's metadata names the one to
use (`AttentionMetadata.backend`, from the engine's `attention_backend`):
- "torch": `sdpa.paged_attention`, the CPU hot path (with the C decode kernel), also correct on GPUs;
- "triton": `triton_paged.paged_attention`, Triton kernels for GPUs (imported only when chosen).
"""

from __future__ import annotations

from torch import Tensor

from pagedserve.attention import sdpa
from pagedserve.attention.metadata import AttentionMetadata


def paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, md: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, kv_scales: Tensor | None = None) -> Tensor:
    if md.backend == "triton":
        from pagedserve.attention import triton_paged

        return triton_paged.paged_attention(q, k, v, k_cache, v_cache, md, scale, sliding_window, kv_scales)
    return sdpa.paged_attention(q, k, v, k_cache, v_cache, md, scale, sliding_window, kv_scales)
