"""KV cache groups: layers grouped by how they keep K/V, sharing one pool of blocks.

Every layer of a group keeps the same tokens, so a group has one block table per request. A
sliding-window group keeps only the blocks its window can still read; a full-attention group keeps
every block. Groups hold equally many layers (`layers_per_block`), so that one block id names one
page in each of those layer buffers, and a page costs the same bytes whichever group holds it:
memory moves freely between groups. Buffer `slot` j holds the j-th layer of every group; which
group's tokens a block's pages hold is decided by whoever holds the block.

The number of layers per group is the greatest common divisor of the layer counts of each kind,
so no buffer is padded: Gemma-3-27B (52 sliding, 10 full layers) makes 26 sliding and 5 full
groups of 2 layers; a model of one kind makes one group of all its layers.

Layers whose pages differ in bytes (Gemma 4's full and sliding layers: their own head size and KV
heads) cannot share such a pool: ModelConfig.kv_layout gives them one uniform group, each layer
buffer of its own shape (ModelConfig.kv_buffer_shapes). KV-shared layers hold no cache and are not
in the layout.

Pure Python (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.kv.sizes import cdiv


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table: their window (None: full attention) and their indices."""

    window: int | None
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        return "full" if self.window is None else f"sliding {self.window}"


@dataclass(frozen=True)
class KVLayout:
    """The groups of a model's layers and where each layer's K/V lives."""

    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int  # layer buffers a block id spans (the page count of one block)

    @classmethod
    def of(cls, layer_windows: Sequence[int | None]) -> KVLayout:
        """Group layers by window, in layer order within each kind, kinds in order of first
        appearance."""
        if not layer_windows:
            raise ValueError("a model needs at least one layer with a KV cache")
        by_window: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            if window is not None and window < 1:
                raise ValueError(f"layer {layer}: sliding window must be positive, got {window}")
            by_window.setdefault(window, []).append(layer)
        per = math.gcd(*(len(layers) for layers in by_window.values()))
        groups = tuple(KVCacheGroup(window, tuple(layers[i:i + per]))
                       for window, layers in by_window.items() for i in range(0, len(layers), per))
        return cls(groups, per)

    @classmethod
    def uniform(cls, num_layers: int) -> KVLayout:
        return cls.of([None] * num_layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def summary(self) -> str:
        """The groups in words, kinds in order: "31 groups of 2 layers: 26 x sliding 1024, 5 x full"."""
        kinds: dict[str, int] = {}
        for group in self.groups:
            kinds[group.kind] = kinds.get(group.kind, 0) + 1
        n, per = self.num_groups, self.layers_per_block
        return (f"{n} group{'s' if n > 1 else ''} of {per} layer{'s' if per > 1 else ''}: "
                + ", ".join(f"{count} x {kind}" for kind, count in kinds.items()))

    def layer_places(self) -> list[tuple[int, int]]:
        """(group, buffer slot) of each layer, by layer index."""
        places: dict[int, tuple[int, int]] = {}
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                places[layer] = (g, slot)
        return [places[layer] for layer in range(len(places))]

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks one request of `num_tokens` tokens holds at once, computed `chunk` tokens a
        step: a full group every block, a sliding group its window plus the step's chunk."""
        total = 0
        for window in self.windows:
            blocks = cdiv(num_tokens, block_size)
            if window is not None:
                blocks = min(blocks, cdiv(window - 1 + min(chunk, num_tokens), block_size) + 1)
            total += blocks
        return total

    def max_tokens(self, num_blocks: int, block_size: int, chunk: int, limit: int) -> int:
        """The longest request (at most `limit` tokens) that fits alone in `num_blocks` blocks."""
        lo, hi = 0, limit
        while lo < hi:  # the block count grows with the length: bisect
            mid = (lo + hi + 1) // 2
            if self.blocks_per_request(mid, block_size, chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo
