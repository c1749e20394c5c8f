"""Paged attention: the KV cache layout, per-step metadata, and the backends that read K/V through
block tables.

The engine picks its backend once, by the `attention_backend` it was configured with
(`get_backend`). Each step, that backend builds the step's metadata; every attention layer runs
the backend the metadata names (`md.backend.forward`). Backends:
- "torch": `sdpa.SdpaBackend`, the CPU hot path (with the C decode kernel), also correct on GPUs;
- "triton": `triton_paged.TritonBackend`, Triton kernels for GPUs (imported only when chosen).
`torch_ref` is the oracle the tests check both against; nothing in production uses it.

Nothing is imported here at module level, so that importing one module of the package (the
oracle, say) loads no backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from pagedserve.attention.metadata import AttentionMetadata

BACKENDS = ("torch", "triton")


class AttentionBackend(Protocol):
    """An attention implementation: builds each step's metadata, then runs every layer on it."""

    name: str  # the attention_backend value that selects it

    def build_metadata(
        self,
        block_tables: list[list[int]] | Tensor,
        num_computed_tokens: list[int],
        num_new_tokens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """The step's metadata (see `AttentionMetadata.build` for the arguments), with this
        backend as its `backend`."""
        ...

    def forward(self, q: Tensor, k: Tensor | None, v: Tensor | None, k_cache: Tensor, v_cache: Tensor, md: AttentionMetadata,
                scale: float, sliding_window: int | None = None, kv_scales: Tensor | None = None,
                sinks: Tensor | None = None) -> Tensor:
        """Store this step's K/V in their slots, then attend for every request over its whole context:
        the contract of `torch_ref.paged_attention` (sinks: the layer's [num_heads] float32 sink
        logits, gpt-oss style, or None). k = v = None: store nothing (a KV-shared layer, reading the
        cache its source layer wrote this step)."""
        ...


def get_backend(name: str, device: torch.device | None = None, kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend an engine configured with attention_backend=`name` runs ("torch" or "triton").
    Given the engine's device and KV element type, a backend that cannot run them is a ValueError
    that says why (the config names a backend; the backend knows what it supports)."""
    if name == "torch":
        from pagedserve.attention.sdpa import SdpaBackend

        return SdpaBackend()
    if name == "triton":
        from pagedserve.attention.triton_paged import TritonBackend, available, fp8_supported

        if device is not None:
            import torch

            reason = available(device) or (kv_dtype == torch.float8_e4m3fn and fp8_supported(device))
            if reason:
                raise ValueError(reason)
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")
