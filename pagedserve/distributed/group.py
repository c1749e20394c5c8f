"""A rank's tensor-parallel group: who it is, and the two collectives a sharded model needs.

The model calls these inside its forward pass; with size 1 they do nothing, so a model built for
one process runs no torch.distributed code at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (None with size 1)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum x over the ranks, in place (a row-parallel layer's partial products)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: Tensor) -> Tensor | None:
        """Rank 0: every rank's x side by side, [rows, size * columns]; other ranks: None
        (vocab-parallel logits: only the driver samples)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(x, parts, dst=self._global(0), group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def _global(self, rank: int) -> int:
        return torch.distributed.get_global_rank(self.group, rank) if self.group is not None else rank
